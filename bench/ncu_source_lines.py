#!/usr/bin/env python3
"""Per-source-line totals from Nsight Compute's source page, largest first.

The source page lists, for each CUDA source line, the line's totals and then its SASS
instructions; this sums the line rows only (the SASS rows repeat them). Make the CSV with

    ncu --section SourceCounters -k regex:chunk_backward_kernel -c 1 -f -o /tmp/cb \
        mamba3_scan_cuda_bench --profile-once [--siso]
    ncu -i /tmp/cb.ncu-rep --page source --csv --print-source cuda,sass > cb.csv

(the scan's sources are built with -lineinfo: CMakeLists.txt), then

    python3 bench/ncu_source_lines.py cb.csv [--by excessive|wavefronts|instructions|samples] [--top N]

Columns: each line's share of the kernel's excessive shared-memory wavefronts (bank
conflicts), of all shared wavefronts, of warp instructions executed, and of warp-stall
samples.
"""
import argparse
import collections
import csv

COLUMNS = {
    "excessive": "L1 Wavefronts Shared Excessive",
    "wavefronts": "L1 Wavefronts Shared",
    "instructions": "Instructions Executed",
    "samples": "Warp Stall Sampling (All Samples)",
}


def number(text):
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv_file")
    parser.add_argument("--by", choices=sorted(COLUMNS), default="excessive")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    names = list(COLUMNS)
    lines = collections.defaultdict(lambda: [0.0] * len(names))
    text = {}
    totals = [0.0] * len(names)
    file_name, header = "?", None
    with open(args.csv_file, newline="") as f:
        for row in csv.reader(f):
            if not row:
                continue
            if row[0] == "File Path":
                file_name = row[1].rsplit("/", 1)[-1]
            elif row[0] == "Line No":
                header = row
            elif header is not None and row[0].isdigit() and len(row) >= len(header):
                key = (file_name, int(row[0]))
                text.setdefault(key, row[1].strip())
                for k, name in enumerate(names):
                    # A kernel without shared memory has no shared-wavefront columns: zeros.
                    if COLUMNS[name] not in header:
                        continue
                    value = number(row[header.index(COLUMNS[name])])
                    lines[key][k] += value
                    totals[k] += value
    if header is None:
        raise SystemExit(f"{args.csv_file}: no 'Line No' header: not an ncu --page source CSV")
    print("totals: " + ", ".join(f"{n} {t:.4g}" for n, t in zip(names, totals)))
    by = names.index(args.by)
    ranked = sorted(lines.items(), key=lambda item: -item[1][by])[: args.top]
    for (name, line), values in ranked:
        shares = " ".join(
            f"{n[:4]} {100 * v / t if t else 0:5.1f}%" for n, v, t in zip(names, values, totals))
        print(f"{name}:{line:<5d} {shares} | {text[(name, line)][:70]}")


if __name__ == "__main__":
    main()
