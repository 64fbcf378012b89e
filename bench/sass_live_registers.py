#!/usr/bin/env python3
"""Live registers and register spills of one kernel, by source line, with no GPU.

nvdisasm prints either the source line of each SASS instruction (-g) or the number of live
registers at it (--life-range-mode count), not both: this runs it twice on one function of a
cubin and joins the two by instruction address. The development machine's CUDA has no
nvdisasm; the Triton wheel carries one (a tool, never part of the build):

    pip download --no-deps triton -d /tmp/tw
    unzip -j /tmp/tw/triton-*.whl '*/bin/nvdisasm' '*/bin/cuobjdump' -d /tmp/tbin

Make the cubin with the kernel's compile command (compile_commands.json) with `-c` replaced by
`-cubin`, `-o` pointed at the cubin and `-arch=sm_90a` for the --generate-code option (the scan's
sources carry -lineinfo), find the function's symbol index (the hex number after its name on
`cuobjdump -elf X.cubin | grep 'register count'`), then

    python3 bench/sass_live_registers.py X.cubin 0x13 [--nvdisasm /tmp/tbin/nvdisasm] [--top N]

Prints the kernel's instruction count, its largest live-register count, a histogram, the
source lines with the most live registers, and every source line holding a spill (STL) or a
reload (LDL). A line's figures cover its inlined copies (one row per file and line).
"""
import argparse
import collections
import re
import subprocess
import sys

INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(\S+)")
SOURCE_LINE = re.compile(r'//## File "([^"]+)", line (\d+)')
LIVE_GPRS = re.compile(r"// \|\s+(\d+)\s+\|")


def disassemble(nvdisasm, cubin, function, options):
    run = subprocess.run(
        [nvdisasm, "-fun", function, *options, cubin], capture_output=True, text=True
    )
    if run.returncode != 0:
        sys.exit(f"sass_live_registers: {nvdisasm} failed on {cubin} function {function}: "
                 f"{run.stderr.strip()}")
    return run.stdout.splitlines()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cubin")
    parser.add_argument("function", help="symbol index of the kernel, as nvdisasm's -fun takes it")
    parser.add_argument("--nvdisasm", default="nvdisasm")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()

    where = {}
    current = None
    for line in disassemble(args.nvdisasm, args.cubin, args.function, ["-g"]):
        source = SOURCE_LINE.search(line)
        if source:
            current = (source.group(1).rsplit("/", 1)[-1], int(source.group(2)))
            continue
        instruction = INSTRUCTION.search(line)
        if instruction and current:
            where[int(instruction.group(1), 16)] = current

    live, opcode = {}, {}
    for line in disassemble(args.nvdisasm, args.cubin, args.function, ["-lrm", "count"]):
        instruction = INSTRUCTION.search(line)
        count = LIVE_GPRS.search(line)
        if instruction and count:
            address = int(instruction.group(1), 16)
            live[address] = int(count.group(1))
            opcode[address] = instruction.group(2)
    if not live:
        sys.exit(f"sass_live_registers: no instructions for function {args.function} in "
                 f"{args.cubin} (is the symbol index right?)")

    # Per (file, line): most live registers, instructions, spills (STL), reloads (LDL).
    lines = collections.defaultdict(lambda: [0, 0, 0, 0])
    for address, count in live.items():
        row = lines[where.get(address, ("?", 0))]
        row[0] = max(row[0], count)
        row[1] += 1
        row[2] += opcode[address].startswith("STL")
        row[3] += opcode[address].startswith("LDL")
    spills = sum(row[2] for row in lines.values())
    reloads = sum(row[3] for row in lines.values())
    print(f"{len(live)} instructions, at most {max(live.values())} live registers, "
          f"{spills} STL, {reloads} LDL")
    histogram = collections.Counter(count // 8 * 8 for count in live.values())
    print("instructions by live registers (8 wide): " +
          ", ".join(f"{low}-{low + 7}: {n}" for low, n in sorted(histogram.items())))
    print(f"\n| file | line | most live | instructions | STL | LDL |\n|---|---|---|---|---|---|")
    ranked = sorted(lines.items(), key=lambda item: (-item[1][0], -item[1][1]))
    for (name, number), row in ranked[:args.top]:
        print(f"| {name} | {number} | {row[0]} | {row[1]} | {row[2]} | {row[3]} |")
    print("\nlines with spills or reloads:\n| file | line | most live | instructions | STL | LDL |"
          "\n|---|---|---|---|---|---|")
    for (name, number), row in sorted(lines.items()):
        if row[2] or row[3]:
            print(f"| {name} | {number} | {row[0]} | {row[1]} | {row[2]} | {row[3]} |")


if __name__ == "__main__":
    main()
