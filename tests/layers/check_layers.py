#!/usr/bin/env python3
"""The include graph of the source tree, checked against the layering rules.

Nodes are folders (the folder of each source file); an edge A -> B means a file in A includes
"B/...". Two rules:
  1. Layers point down. Each top-level folder has a rank; a folder may include folders of its
     own rank or below, never above:
       base 0 < kernels 1 < runtime, receipts 2 < service, proto 3 < daemon 4 < cli 5
     and inside kernels, cpu/ and cuda/ see only contracts/ (never each other).
  2. No folder cycles: no set of folders that include each other round a loop.
tests/ and bench/ are consumers and may include anything. Exit 0 when both rules hold,
otherwise 1 with every violation printed. Usage: check_layers.py [SOURCE_DIR]
"""
import os
import re
import sys

RANKS = {"base": 0, "kernels": 1, "runtime": 2, "receipts": 2, "service": 3,
         "megacpp": 3,  # the generated protobuf code (proto/megacpp/v1 -> "megacpp/v1/x.pb.h")
         "daemon": 4, "cli": 5}
SOURCE_DIRS = ["base", "kernels", "runtime", "receipts", "service", "daemon", "cli"]
EXTENSIONS = (".h", ".hpp", ".cpp", ".cu", ".cuh")
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


def top(folder):
    return folder.split("/", 1)[0]


def include_graph(root):
    edges = {}
    for source_dir in SOURCE_DIRS:
        for dirpath, _, files in os.walk(os.path.join(root, source_dir)):
            for name in files:
                if not name.endswith(EXTENSIONS):
                    continue
                path = os.path.join(dirpath, name)
                folder = os.path.relpath(dirpath, root)
                with open(path, encoding="utf-8") as f:
                    for target in INCLUDE.findall(f.read()):
                        target_folder = os.path.dirname(target)
                        if not target_folder or target_folder == folder:
                            continue
                        edges.setdefault(folder, {}).setdefault(target_folder, []).append(
                            os.path.relpath(path, root))
    return edges


def layer_violations(edges):
    problems = []
    for src, targets in sorted(edges.items()):
        for dst, files in sorted(targets.items()):
            src_rank, dst_rank = RANKS.get(top(src)), RANKS.get(top(dst))
            if dst_rank is None:
                problems.append(f"{files[0]} includes from {dst}/, which is no known layer")
            elif src_rank < dst_rank:
                problems.append(f"upward: {files[0]} ({top(src)}, rank {src_rank}) includes "
                                f"{dst}/ ({top(dst)}, rank {dst_rank})")
            elif top(src) == top(dst) == "kernels" and dst != "kernels/contracts":
                problems.append(f"sideways: {files[0]} includes {dst}/; kernel backends share "
                                f"only kernels/contracts/")
    return problems


def cycles(edges):
    """Strongly connected components with more than one folder (Tarjan)."""
    index, low, on_stack, stack, result = {}, {}, set(), [], []
    counter = [0]
    nodes = set(edges) | {d for t in edges.values() for d in t}

    def visit(node):
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for nxt in edges.get(node, {}):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                result.append(sorted(component))

    for node in sorted(nodes):
        if node not in index:
            visit(node)
    return result


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..", "..")
    edges = include_graph(root)
    problems = layer_violations(edges)
    for component in cycles(edges):
        links = [f"{a} -> {b} ({edges[a][b][0]})" for a in component for b in edges.get(a, {})
                 if b in component]
        problems.append("cycle between " + ", ".join(component) + ": " + "; ".join(links))
    for problem in problems:
        print(problem)
    folders = len(set(edges) | {d for t in edges.values() for d in t})
    print(f"{folders} folders, {sum(len(t) for t in edges.values())} folder edges, "
          f"{len(problems)} violations")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
