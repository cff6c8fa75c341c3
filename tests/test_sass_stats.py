"""tools/sass_stats.py's reading of cuobjdump and ptxas output (no CUDA toolkit needed): the main
loop is the predicated backward branch around the most wgmma instructions, not the unconditional
jump back from a barrier-wait retry that spans everything, and its largest forward-skipped block
is the rare path; ptxas's registers and spills land on their kernels; build tags leave the key."""
import pytest

from test_examples import ROOT, load

sass_stats = load(ROOT / "tools" / "sass_stats.py", "sass_stats")

MANGLED = "_ZN11dualkv_sm9051_GLOBAL__N__8a5a49e2_18_dualkv_bwd_sm90_cu_5c1c633114dkdv_dq_kernelI13__nv_bfloat16Lb0EEEv"


def sass(lines):
    body = "\n".join(f"        /*{address:04x}*/                   {text} ;   /* 0x0000000000000000 */"
                     for address, text in lines)
    return f"\tcode for sm_90a\n\t\tFunction : {MANGLED}\n\t.headerflags\n{body}\n"


# a loop at 0x40-0xd0: two wgmmas, a masked block 0x80-0xb0 that a forward branch skips; a wgmma
# after it (a tail), and a retry block after the kernel's end that jumps back unconditionally to
# its start, around all three
PROGRAM = [
    (0x00, "MOV R1, c[0x0][0x28]"),
    (0x10, "@!P0 BRA 0x100"),
    (0x40, "HGMMA.64x64x16.F32.BF16 R24, gdesc[UR16], RZ, !UPT"),
    (0x50, "HGMMA.64x64x16.F32.BF16 R24, gdesc[UR16], R24, gsb0"),
    (0x60, "MUFU.EX2 R2, R2"),
    (0x70, "@P1 BRA 0xb0"),
    (0x80, "ISETP.GE.AND P2, PT, R3, R4, PT"),
    (0x90, "FSEL R2, R2, RZ, !P2"),
    (0xa0, "@P6 ISETP.LT.OR P2, PT, R5, R4, P2"),
    (0xb0, "STSM.16.M88.4 [R9], R184"),
    (0xc0, "IADD3 R3, R3, 0x1, RZ"),
    (0xd0, "@!P0 BRA 0x40"),
    (0xe0, "HGMMA.64x64x16.F32.BF16 R24, gdesc[UR20], R24, gsb0"),
    (0xf0, "EXIT"),
    (0x100, "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR9+0x34400], R4"),
    (0x110, "BRA 0x00"),
]


def test_the_main_loop_and_its_rare_block():
    (kernel,) = sass_stats.parse_sass(sass(PROGRAM))
    assert kernel.name == MANGLED and len(kernel.instructions) == len(PROGRAM)
    loop = sass_stats.main_loop(kernel)
    assert (loop.start, loop.end, loop.skipped) == (0x40, 0xd0, (0x80, 0xb0))
    counts = sass_stats.loop_opcodes(kernel, loop, skip_block=False)
    assert counts["HGMMA"] == 2 and counts["ISETP"] == 2 and sum(counts.values()) == 10
    rest = sass_stats.loop_opcodes(kernel, loop, skip_block=True)
    assert rest["ISETP"] == 0 and rest["FSEL"] == 0 and sum(rest.values()) == 7
    assert [ins.predicated for ins in kernel.instructions if ins.opcode == "ISETP"] == [False, True]


def test_a_kernel_without_wgmma_has_no_main_loop():
    (kernel,) = sass_stats.parse_sass(sass([(0x00, "IADD3 R1, R1, 0x1, RZ"), (0x10, "@P0 BRA 0x00")]))
    assert sass_stats.main_loop(kernel) is None


def test_ptxas_resources_land_on_their_kernels():
    log = ("ptxas info    : Compiling entry function 'a' for 'sm_90a'\n"
           "    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
           "ptxas info    : Used 168 registers, used 16 barriers\n"
           "ptxas info    : Compiling entry function 'b' for 'sm_90a'\n"
           "    256 bytes stack frame, 96 bytes spill stores, 64 bytes spill loads\n"
           "ptxas info    : Used 255 registers, used 1 barriers\n")
    assert sass_stats.ptxas_resources(log) == {"a": (168, 0), "b": (255, 160)}


def test_build_tags_leave_the_kernel_key():
    other = MANGLED.replace("8a5a49e2", "0123abcd").replace("5c1c6331", "fedc9876")
    assert sass_stats.same_kernel_key(MANGLED) == sass_stats.same_kernel_key(other)
    assert "dkdv_dq_kernel" in sass_stats.same_kernel_key(MANGLED)
    assert "GLOBAL" not in sass_stats.same_kernel_key(MANGLED)


def test_a_missing_toolkit_is_named(monkeypatch):
    monkeypatch.setattr(sass_stats.shutil, "which", lambda tool: None)
    monkeypatch.setattr("sys.argv", ["sass_stats.py"])
    with pytest.raises(SystemExit, match="needs nvcc on the PATH"):
        sass_stats.main()
