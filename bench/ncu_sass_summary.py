"""Where a kernel's warps spend their time, from Nsight Compute's per-SASS source page.

    ncu -i REPORT.ncu-rep --page source --csv --print-source sass > sass.csv
    python bench/ncu_sass_summary.py sass.csv [--top 20]

For each kernel in the CSV: executed warp instructions by opcode; the stall samples by
**region**, a region being the SASS lines executed equally often (a loop body, the part of it
only some warps run, a per-tile prologue: the backward of session 49 split 950 instructions
per warp and query tile into its main body, a 176-line per-pair prologue and dQ this way);
the stall reasons by opcode; and the most sampled lines. Session 49 read the H200 backward's
profile by hand with this arithmetic; `bash bench/gpu_session.sh stalls` now prints it.
"""

from __future__ import annotations

import argparse
import csv
import re
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field


@dataclass
class SassLine:
    index: int
    source: str
    executed: int
    samples: int
    stalls: dict[str, int]

    @property
    def opcode(self) -> str:
        """The opcode without its predicate and modifiers (`@!P0 IMAD.MOV.U32` -> IMAD)."""
        words = re.sub(r"^@!?U?P\w+\s+", "", self.source.strip()).split()
        return words[0].split(".")[0] if words else "?"


@dataclass
class KernelLines:
    name: str
    lines: list[SassLine] = field(default_factory=list)


def number(text: str) -> int:
    """A CSV cell as an integer (ncu writes '-' or '' for none, and may group digits)."""
    text = text.replace(",", "").strip()
    return int(float(text)) if text and text != "-" else 0


def read_kernels(path: str) -> Iterator[KernelLines]:
    """The kernels of an `ncu --page source --csv --print-source sass` file: each starts with a
    "Kernel Name" row, then its header row, then one row per SASS line."""
    kernel: KernelLines | None = None
    header: dict[str, int] = {}
    with open(path, newline="") as f:
        for row in csv.reader(f):
            if not row:
                continue
            if row[0] == "Kernel Name":
                if kernel is not None:
                    yield kernel
                kernel, header = KernelLines(row[1] if len(row) > 1 else "?"), {}
            elif kernel is not None and not header:
                header = {name: i for i, name in enumerate(row)}
            elif kernel is not None and len(row) == len(header) and "Source" in header:
                stalls = {
                    name.removeprefix("stall_"): number(row[i])
                    for name, i in header.items()
                    if name.startswith("stall_") and "Not Issued" not in name
                }
                kernel.lines.append(
                    SassLine(
                        len(kernel.lines),
                        row[header["Source"]],
                        number(row[header.get("Instructions Executed", -1)])
                        if "Instructions Executed" in header
                        else 0,
                        number(row[header["Warp Stall Sampling (All Samples)"]])
                        if "Warp Stall Sampling (All Samples)" in header
                        else 0,
                        stalls,
                    )
                )
    if kernel is not None:
        yield kernel


def summarize(kernel: KernelLines, top: int) -> str:
    lines = kernel.lines
    executed = sum(line.executed for line in lines)
    samples = sum(line.samples for line in lines) or 1
    out = [f"{kernel.name}: {len(lines)} SASS lines, {executed:,} warp instructions, {samples:,} stall samples"]
    by_opcode = Counter()
    for line in lines:
        by_opcode[line.opcode] += line.executed
    out.append(
        "  executed by opcode: " + ", ".join(f"{op} {n / max(executed, 1):.1%}" for op, n in by_opcode.most_common(top))
    )
    regions: dict[int, list[SassLine]] = {}
    for line in lines:
        regions.setdefault(line.executed, []).append(line)
    out.append("  regions (lines executed equally often), by stall samples:")
    ranked = sorted(regions.items(), key=lambda item: -sum(line.samples for line in item[1]))
    for count, members in ranked[:top]:
        share = sum(line.samples for line in members) / samples
        ops = Counter(line.opcode for line in members).most_common(8)
        out.append(
            f"    {count:>12,} x {len(members):4d} lines (first {members[0].index:5d}): {share:6.1%} of samples; "
            + ", ".join(f"{op} {n}" for op, n in ops)
        )
    reasons = Counter()
    for line in lines:
        for reason, n in line.stalls.items():
            if reason != "selected":
                reasons[(line.opcode, reason)] += n
    out.append(
        "  stall reasons by opcode: "
        + ", ".join(f"{op}/{r} {n / samples:.1%}" for (op, r), n in reasons.most_common(top))
    )
    out.append("  most sampled lines:")
    for line in sorted(lines, key=lambda line: -line.samples)[:top]:
        reason = max(line.stalls.items(), key=lambda item: item[1])[0] if line.stalls else "-"
        out.append(
            f"    {line.index:5d} {line.samples / samples:6.2%} ({reason:14s}) x{line.executed:>12,}  {line.source.strip()}"
        )
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("csv", help="ncu --page source --csv --print-source sass output")
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()
    kernels = list(read_kernels(args.csv))
    if not kernels:
        sys.exit(f"{args.csv}: no kernel rows (expected ncu's --page source --csv --print-source sass output)")
    for kernel in kernels:
        print(summarize(kernel, args.top), flush=True)


if __name__ == "__main__":
    main()
