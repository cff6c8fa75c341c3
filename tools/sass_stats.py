"""Instruction counts of the native kernels, on a machine without a GPU.

Each source under ``csrc/`` compiles to a cubin for sm_90a (``nvcc -cubin``, as the extension
builds it), and ``cuobjdump -sass`` lists its instructions. Per kernel this prints the registers and
spills that ptxas reports, the static instruction count, and its main loop: the backward branch
that spans the most wgmma instructions. Inside the loop, the largest block that a forward branch
skips is named apart, since that is how a rare path (a mask, a tail) shows: a step that skips it
issues the rest. Also the loop's opcodes by count, and against a second source folder (``--base``,
another revision's ``csrc/``) the difference per opcode:

    python tools/sass_stats.py --files "dualkv_bwd_sm90.cu" --kernels bfloat16Lb0      # this checkout
    python tools/sass_stats.py --base ab/base/csrc --files "dualkv_bwd*.cu"           # against main's

Needs nvcc (CUDA 12.3 or newer) and cuobjdump with nvdisasm on the PATH; without a CUDA toolkit,
``pip download nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm`` and unpack their ``bin`` folders. An
instruction count is not a time: where the steps' time goes is measured on the GPU (``ncu``,
``tools/ab_native.py``). It says what a change did to the code the GPU runs before a device call.
"""
from __future__ import annotations

import argparse
import collections
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

ROOT = Path(__file__).resolve().parents[1]
NVCC_FLAGS = ["-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", "-cubin"]
# one SASS line: /*0650*/  [@P0 | @!P0 | @!UP1 ...] OPCODE.MODIFIERS operands ;
INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)((?:\.[A-Z0-9_]+)*)\s*([^;]*);")
BRANCH_TARGET = re.compile(r"0x([0-9a-f]+)")


@dataclass
class Instruction:
    address: int
    opcode: str  # without modifiers: ISETP, HGMMA, ...
    predicated: bool
    operands: str


@dataclass
class Kernel:
    name: str
    instructions: List[Instruction] = field(default_factory=list)
    registers: Optional[int] = None
    spill_bytes: int = 0


@dataclass
class Loop:
    start: int  # the branch target
    end: int  # the backward branch
    skipped: Tuple[int, int]  # the largest block a forward branch inside skips, [start, end) (0, 0 if none)

    def holds(self, address: int) -> bool:
        return self.start <= address <= self.end


def parse_sass(text: str) -> List[Kernel]:
    """cuobjdump -sass output -> its kernels, each with its instructions in address order."""
    kernels = []
    for line in text.splitlines():
        if "Function :" in line:
            kernels.append(Kernel(line.split("Function :", 1)[1].strip()))
            continue
        match = INSTRUCTION.search(line)
        if match and kernels:
            kernels[-1].instructions.append(Instruction(int(match.group(1), 16), match.group(3),
                                                        match.group(2) is not None, match.group(5)))
    return kernels


def branches(kernel: Kernel, conditional: bool = False) -> List[Tuple[int, int]]:
    """(address, target) of every BRA with one target (``conditional``: predicated ones only)."""
    found = []
    for ins in kernel.instructions:
        targets = BRANCH_TARGET.findall(ins.operands) if ins.opcode == "BRA" else []
        if len(targets) == 1 and (ins.predicated or not conditional):
            found.append((ins.address, int(targets[0], 16)))
    return found


def main_loop(kernel: Kernel) -> Optional[Loop]:
    """The loop of the most HGMMA (ties: the shortest), and inside it the largest block a forward
    branch skips. A loop is a predicated backward branch: the jumps back from the out-of-line
    barrier-wait retries are unconditional and span everything."""
    gmma = [ins.address for ins in kernel.instructions if ins.opcode == "HGMMA"]
    loops = [(sum(target <= a <= at for a in gmma), target - at, target, at)
             for at, target in branches(kernel, conditional=True) if target < at]
    if not loops or max(loops)[0] == 0:
        return None
    _, _, start, end = max(loops)
    inside = [(target - at, at + 16, target) for at, target in branches(kernel) if start <= at < target <= end]
    skipped = max(inside)[1:] if inside else (0, 0)
    return Loop(start, end, skipped)


def loop_opcodes(kernel: Kernel, loop: Loop, skip_block: bool) -> collections.Counter:
    """Opcode counts inside the loop; with ``skip_block``, without its skipped block."""
    lo, hi = loop.skipped
    return collections.Counter(ins.opcode for ins in kernel.instructions
                               if loop.holds(ins.address) and not (skip_block and lo <= ins.address < hi))


def ptxas_resources(log: str) -> Dict[str, Tuple[int, int]]:
    """ptxas -v's log -> {mangled kernel name: (registers, spill store + load bytes)}."""
    found, name = {}, None
    for line in log.splitlines():
        entry = re.search(r"Compiling entry function '([^']+)'", line)
        if entry:
            name = entry.group(1)
        spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if spills and name:
            found[name] = (found.get(name, (0, 0))[0], int(spills.group(1)) + int(spills.group(2)))
        registers = re.search(r"Used (\d+) registers", line)
        if registers and name:
            found[name] = (int(registers.group(1)), found.get(name, (0, 0))[1])
    return found


def compile_kernels(source: Path, out: Path) -> List[Kernel]:
    """One source's kernels, with ptxas's registers and spills."""
    cubin = out / (source.stem + ".cubin")
    built = subprocess.run(["nvcc", *NVCC_FLAGS, "-Xptxas", "-v", str(source), "-o", str(cubin)],
                           capture_output=True, text=True)
    if built.returncode:
        raise SystemExit(f"nvcc failed on {source}:\n{built.stderr[-2000:]}")
    sass = subprocess.run(["cuobjdump", "-sass", str(cubin)], capture_output=True, text=True)
    if sass.returncode:
        raise SystemExit(f"cuobjdump failed on {cubin}: {sass.stderr.strip()}")
    kernels = parse_sass(sass.stdout)
    resources = ptxas_resources(built.stderr)
    for kernel in kernels:
        kernel.registers, kernel.spill_bytes = resources.get(kernel.name, (None, 0))
    return kernels


def demangled(names: List[str]) -> Dict[str, str]:
    """Readable names (cu++filt where installed), keyed by the mangled ones."""
    if not shutil.which("cu++filt"):
        return {name: name for name in names}
    out = subprocess.run(["cu++filt"], input="\n".join(names), capture_output=True, text=True).stdout.splitlines()
    return dict(zip(names, out)) if len(out) == len(names) else {name: name for name in names}


def same_kernel_key(name: str) -> str:
    """A mangled name without its anonymous namespace, whose tag differs from build to build."""
    return re.sub(r"\d+_GLOBAL__N__[0-9a-f]+_\d+_\w+?_cu_[0-9a-f]{8}", "", name)


def kernels_of(folder: Path, files: str, pattern: str) -> Dict[str, Kernel]:
    """Every kernel of the folder's ``files`` whose name matches ``pattern``, by ``same_kernel_key``."""
    found = {}
    with tempfile.TemporaryDirectory() as tmp:
        for source in sorted(folder.glob(files)):
            found.update({same_kernel_key(k.name): k for k in compile_kernels(source, Path(tmp))
                          if re.search(pattern, k.name)})
    return found


def report(name: str, kernel: Kernel, base: Optional[Kernel]) -> None:
    loop = main_loop(kernel)
    print(f"{name}\n  {kernel.registers} registers, {kernel.spill_bytes} bytes spilled, "
          f"{len(kernel.instructions)} instructions" + (f" (base {len(base.instructions)})" if base else ""))
    if loop is None:
        print("  no loop of wgmma instructions")
        return
    counts, rest = loop_opcodes(kernel, loop, False), loop_opcodes(kernel, loop, True)
    block = loop.skipped[1] - loop.skipped[0]
    predicated = sum(ins.predicated and ins.opcode != "BRA" for ins in kernel.instructions if loop.holds(ins.address))
    print(f"  main loop {loop.start:#x}-{loop.end:#x}: {sum(counts.values())} instructions ({predicated} predicated), "
          f"{sum(rest.values())} on a step that skips its largest conditional block ({block // 16} at {loop.skipped[0]:#x})")
    base_loop = main_loop(base) if base else None
    base_rest = loop_opcodes(base, base_loop, True) if base_loop else collections.Counter()
    if base_loop:
        print(f"  base's main loop: {sum(base_rest.values())} when its largest skipped block is skipped")
    for op, n in (rest + base_rest).most_common(24):
        line = f"    {op:12s} {rest[op]:5d}"
        print(line + (f" {base_rest[op]:5d} ({rest[op] - base_rest[op]:+d})" if base_loop else ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sources", type=Path, default=ROOT / "csrc", help="folder of .cu files (default: csrc/)")
    parser.add_argument("--base", type=Path, help="another source folder to compare with")
    parser.add_argument("--files", default="*.cu", help="which sources of the folder to compile (a glob)")
    parser.add_argument("--kernels", default=".", help="regular expression on the kernels' mangled names")
    args = parser.parse_args()
    for tool in ("nvcc", "cuobjdump", "nvdisasm"):
        if not shutil.which(tool):
            sys.exit(f"sass_stats needs {tool} on the PATH (see the module docstring)")
    ours = kernels_of(args.sources, args.files, args.kernels)
    base = kernels_of(args.base, args.files, args.kernels) if args.base else {}
    if not ours:
        sys.exit(f"no kernel of {args.sources} matches {args.kernels!r}")
    names = demangled([kernel.name for kernel in ours.values()])
    for key, kernel in ours.items():
        report(names[kernel.name], kernel, base.get(key))


if __name__ == "__main__":
    main()
