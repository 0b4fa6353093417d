"""Every Triton kernel compiles for an H100/H200 (sm_90) on a machine without a GPU.

The interpreter tests (test_triton.py) check what the kernels compute; this checks that the GPU
compiler accepts them (typing, layouts, register allocation by ptxas), ahead of time, for the
format kinds and dtypes the launchers use, at the launchers' warps: that no pointer offset is an
int32 product (the IR), and that nothing spills out of registers (the cubin). It runs in a
subprocess because the kernels must be defined without TRITON_INTERPRET, which test_triton.py sets.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from agoq.compat import major_minor

triton = pytest.importorskip("triton", reason="triton is not installed (pip install 'agoq[triton]')")
# Ahead-of-time compilation names constexprs through ASTSource(constexprs=...), which triton 3.2 and
# 3.3 lack; the kernels run on them (test_triton.py), only this check needs 3.4.
if major_minor(triton.__version__) < (3, 4):
    pytest.skip(f"triton {triton.__version__}: ahead-of-time compilation needs triton 3.4", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[1]

INT4 = dict(KIND=0, BITS=4, NBND=0, MAXV=7.0, BLOCK=128, G=2, GB=1, GBP=1)
INT5_96 = dict(KIND=0, BITS=5, NBND=0, MAXV=15.0, BLOCK=96, G=8, GB=5, GBP=8)
INT8_256 = dict(KIND=0, BITS=8, NBND=0, MAXV=127.0, BLOCK=256, G=1, GB=1, GBP=1)
FP4 = dict(KIND=1, BITS=4, NBND=14, MAXV=6.0, BLOCK=128, G=2, GB=1, GBP=1)
FP8 = dict(KIND=2, BITS=8, NBND=0, MAXV=448.0, BLOCK=128, G=1, GB=1, GBP=1)
PTR = "*u8"
# H of a norm case: the widest row the launchers take (ops.NORM_MAX_HIDDEN), where registers run out first.
WIDEST = "widest"
NORM_QUANTIZE = dict(
    x_ptr="*i16", w_ptr="*bf16", h_ptr="*i16", pay_ptr=PTR, sc_ptr="*fp32", bnd_ptr="*fp32", code_ptr=PTR, T="i32", eps="fp32", nbytes="i32"
)
NORM_RECOMPUTE = dict(pay_ptr=PTR, sc_ptr="*fp32", val_ptr="*fp32", w_ptr="*bf16", h_ptr="*i16", rstd_ptr="*fp32", T="i32", eps="fp32", nbytes="i32")
NORM_BACKWARD = dict(
    gh_ptr="*fp32",
    pay_ptr=PTR,
    sc_ptr="*fp32",
    val_ptr="*fp32",
    rstd_ptr="*fp32",
    w_ptr="*bf16",
    gx_ptr="*i16",
    gw_ptr="*fp32",
    T="i32",
    nbytes="i32",
)


def _unpacking(fmt: dict) -> dict:
    """The constexprs of a kernel that only reads codes."""
    return {k: v for k, v in fmt.items() if k not in ("NBND", "MAXV")}


# (kernel, runtime argument types, constexpr values): one entry per variant worth compiling.
CASES = [
    (
        "quantize_kernel",
        dict(x_ptr="*i16", pay_ptr=PTR, sc_ptr="*fp32", bnd_ptr="*fp32", code_ptr=PTR, n="i32", nblocks="i32", nbytes="i32"),
        dict(IN_BF16=True, BP=128, **INT4),
    ),
    (
        "quantize_kernel",
        dict(x_ptr="*fp32", pay_ptr=PTR, sc_ptr="*fp32", bnd_ptr="*fp32", code_ptr=PTR, n="i64", nblocks="i32", nbytes="i64"),
        dict(IN_BF16=False, BP=128, **INT5_96),
    ),
    (
        "quantize_kernel",
        dict(x_ptr="*i16", pay_ptr=PTR, sc_ptr="*fp32", bnd_ptr="*fp32", code_ptr=PTR, n="i32", nblocks="i32", nbytes="i32"),
        dict(IN_BF16=True, BP=128, **FP4),
    ),
    (
        "quantize_kernel",
        dict(x_ptr="*fp16", pay_ptr=PTR, sc_ptr="*fp32", bnd_ptr="*fp32", code_ptr=PTR, n="i32", nblocks="i32", nbytes="i32"),
        dict(IN_BF16=False, BP=128, **FP8),
    ),
    (
        "dequantize_kernel",
        dict(pay_ptr=PTR, sc_ptr="*fp32", val_ptr="*fp32", out_ptr="*i16", n="i32", nblocks="i32", nbytes="i32"),
        dict(OUT_BF16=True, BP=128, **_unpacking(INT4)),
    ),
    (
        "dequantize_kernel",
        dict(pay_ptr=PTR, sc_ptr="*fp32", val_ptr="*fp32", out_ptr="*fp32", n="i32", nblocks="i32", nbytes="i32"),
        dict(OUT_BF16=False, BP=128, **{k: v for k, v in FP8.items() if k not in ("NBND", "MAXV")}),
    ),
    ("rms_norm_quantize_kernel", NORM_QUANTIZE, dict(IN_BF16=True, H=4096, **INT4)),
    ("rms_norm_quantize_kernel", NORM_QUANTIZE, dict(IN_BF16=True, H=WIDEST, **FP4)),
    ("rms_norm_recompute_kernel", NORM_RECOMPUTE, dict(OUT_BF16=True, H=4096, **_unpacking(INT4))),
    ("rms_norm_recompute_kernel", NORM_RECOMPUTE, dict(OUT_BF16=True, H=WIDEST, **_unpacking(FP8))),
    ("rms_norm_backward_kernel", NORM_BACKWARD, dict(GH_BF16=False, OUT_BF16=True, NEED_GW=True, H=4096, **_unpacking(INT4))),
    ("rms_norm_backward_kernel", NORM_BACKWARD, dict(GH_BF16=False, OUT_BF16=True, NEED_GW=True, H=WIDEST, **_unpacking(FP4))),
    (
        "swiglu_quantize_kernel",
        dict(
            g_ptr="*i16",
            u_ptr="*i16",
            act_ptr="*i16",
            gpay_ptr=PTR,
            gsc_ptr="*fp32",
            upay_ptr=PTR,
            usc_ptr="*fp32",
            bnd_ptr="*fp32",
            code_ptr=PTR,
            n="i32",
            nblocks="i32",
            nbytes="i32",
        ),
        dict(IN_BF16=True, BP=128, **INT4),
    ),
    (
        "swiglu_backward_kernel",
        dict(
            ga_ptr="*i16",
            gpay_ptr=PTR,
            gsc_ptr="*fp32",
            upay_ptr=PTR,
            usc_ptr="*fp32",
            val_ptr="*fp32",
            act_ptr="*i16",
            gg_ptr="*i16",
            gu_ptr="*i16",
            n="i32",
            nblocks="i32",
            nbytes="i32",
        ),
        dict(GA_BF16=True, OUT_BF16=True, NEED_ACT=True, BP=128, **{k: v for k, v in INT4.items() if k not in ("NBND", "MAXV")}),
    ),
    (
        "accumulate_kernel",
        dict(
            pay_ptr=PTR, sc_ptr="*fp32", g_ptr="*fp32", val_ptr="*fp32", bnd_ptr="*fp32", code_ptr=PTR, k="i32", n="i32", nblocks="i32", nbytes="i32"
        ),
        dict(FIRST=False, IN_BF16=False, BP=256, **INT8_256),
    ),
    (
        "reduce_rows_kernel",
        dict(
            pay_ptr=PTR,
            row_stride="i32",
            sc_ptr="*fp32",
            val_ptr="*fp32",
            bnd_ptr="*fp32",
            code_ptr=PTR,
            acc_ptr="*fp32",
            out_pay_ptr=PTR,
            out_sc_ptr="*fp32",
            W="i32",
            nblocks="i32",
            nbytes="i32",
        ),
        dict(AVG=True, STORE_SUM=True, REQUANT=True, BP=256, **INT8_256),
    ),
]


_OP = re.compile(r"^\s*(%[\w]+)(?::\d+)?\s*=\s*([\w.\"]+)(.*)$")


def _ops(ttir: str) -> dict[str, tuple[str, list[str], str]]:
    """Each SSA value of a Triton IR listing: (operation, operands, result type)."""
    ops = {}
    for line in ttir.splitlines():
        m = _OP.match(re.sub(r"\s*loc\(.*$", "", line))
        if m:
            name, op, rest = m.groups()
            body, _, result = rest.rpartition(" : ")
            ops[name] = (op, [o.split("#")[0] for o in re.findall(r"%[\w#]+", body)], result.strip())
    return ops


def _int32(result: str) -> bool:
    return re.search(r"(^|x)i32>?$", result) is not None


def int32_offset_products(ttir: str) -> list[str]:
    """The int32 multiplies of a runtime value (an argument, a program id, a loop variable) that
    feed a pointer offset: where a product of sizes or indices can pass 2**31 and wrap."""
    ops = _ops(ttir)

    def runtime(v: str, seen: frozenset = frozenset()) -> bool:
        if v not in ops:  # a kernel argument or a loop's block argument
            return True
        op, operands, _ = ops[v]
        if op in ("arith.constant", "tt.make_range") or v in seen:
            return False
        return not operands or any(runtime(o, seen | {v}) for o in operands)  # no operands: program id, count

    bad, todo, seen = set(), [operands[1] for op, operands, _ in ops.values() if op == "tt.addptr"], set()
    while todo:
        v = todo.pop()
        if v in seen or v not in ops:
            continue
        seen.add(v)
        op, operands, result = ops[v]
        if op == "arith.muli" and _int32(result) and any(runtime(o) for o in operands):
            bad.add(f"{v} = {op} {', '.join(operands)} : {result}")
        todo.extend(operands)
    return sorted(bad)


def products_of(ttir: str, arg: str) -> list[str]:
    """Result types of the multiplies that take kernel argument ``arg`` (directly, or widened or splat)."""
    ops = _ops(ttir)
    forms = {f"%{arg}"} | {v for v, (op, operands, _) in ops.items() if op in ("arith.extsi", "tt.splat") and operands == [f"%{arg}"]}
    return [result for op, operands, result in ops.values() if op == "arith.muli" and forms & set(operands)]


def compile_all() -> list[dict]:
    """Compile every case for sm_90 down to a cubin, at the launchers' tiling and warps: what each
    case's IR and code show."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from agoq.quant.triton import kernels, ops

    target = GPUTarget("cuda", 90, 32)
    cuobjdump = triton.knobs.nvidia.cuobjdump.path
    results = []
    for name, types, consts in CASES:
        fn = getattr(kernels, name)
        warps = ops.GPU_WARPS
        if "R" in fn.arg_names:  # blocks per program, as the launchers pick them on a GPU
            consts = dict(consts, R=max(1, ops.GPU_TILE // consts["BP"]))
        if "H" in fn.arg_names:  # rows per program and warps, as the norm launchers pick them
            hidden = ops.NORM_MAX_HIDDEN if consts["H"] == WIDEST else consts["H"]
            hp, rt = ops._row_tiling(hidden)
            consts = dict(consts, H=hidden, HP=hp, RT=rt)
            warps = ops.norm_warps(hp)
        missing = [a for a in fn.arg_names if a not in types and a not in consts]
        if missing:
            raise AssertionError(f"{name}: no type or value for {missing}")
        signature = {a: "constexpr" if a in consts else types[a] for a in fn.arg_names}
        src = ASTSource(fn=fn, signature=signature, constexprs=dict(consts))
        compiled = triton.compile(src, target=target, options={"num_warps": warps, "enable_fp_fusion": False})
        cubin = compiled.asm.get("cubin")
        if not cubin:
            raise AssertionError(f"{name}: no cubin")
        registers = stack = None
        if cuobjdump and os.path.exists(cuobjdump):
            path = Path(os.environ.get("TMPDIR", "/tmp")) / f"agoq-{os.getpid()}-{name}.cubin"
            path.write_bytes(cubin)
            try:
                usage = subprocess.run([cuobjdump, "--dump-resource-usage", str(path)], capture_output=True, text=True, check=True).stdout
            finally:
                path.unlink()
            registers, stack = (int(v) for v in re.search(r"REG:(\d+) STACK:(\d+)", usage).groups())
        ttir = compiled.asm["ttir"]
        results.append(
            dict(
                case=f"{name} H={consts.get('H')} BLOCK={consts['BLOCK']} KIND={consts['KIND']} warps={warps}",
                name=name,
                cubin_bytes=len(cubin),
                registers=registers,
                stack_bytes=stack,
                int32_offsets=int32_offset_products(ttir),
                row_stride_products=products_of(ttir, "row_stride") if "row_stride" in fn.arg_names else None,
                nblocks_products=products_of(ttir, "nblocks") if name == "reduce_rows_kernel" else None,
            )
        )
    return results


@pytest.fixture(scope="module")
def compiled() -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "src"), env.get("PYTHONPATH", "")])
    code = "import json\nfrom tests.test_triton_compile import compile_all\nprint(json.dumps(compile_all()))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_every_kernel_compiles_for_sm90(compiled: list[dict]) -> None:
    assert len(compiled) == len(CASES)
    assert all(c["cubin_bytes"] > 0 for c in compiled), compiled


def test_pointer_offsets_are_int64_products(compiled: list[dict]) -> None:
    """An 8-bit reduce-scatter of 2**31 values or more has row r start r * row_stride >= 2**31
    bytes in: every product that makes an offset is int64, program ids and row indices widened first."""
    assert {c["case"]: c["int32_offsets"] for c in compiled if c["int32_offsets"]} == {}
    (rows,) = [c for c in compiled if c["name"] == "reduce_rows_kernel"]
    assert rows["row_stride_products"] == ["i64"], rows  # row r's bytes: r * row_stride
    assert rows["nblocks_products"] == ["i64"], rows  # row r's scales: r * nblocks


def test_no_kernel_spills_registers(compiled: list[dict]) -> None:
    """At the launchers' warps, and for the norm kernels at the widest row they take, every value
    stays in registers: a spill goes to local memory, and norm_supported's limit would be a claim."""
    if any(c["stack_bytes"] is None for c in compiled):
        pytest.skip("no cuobjdump beside triton to read the cubins' register use")
    spilled = {c["case"]: f"{c['registers']} registers, {c['stack_bytes']} bytes on the stack" for c in compiled if c["stack_bytes"]}
    assert spilled == {}
