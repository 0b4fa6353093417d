"""Every Triton kernel compiles for an H100/H200 (sm_90) on a machine without a GPU.

The interpreter tests (test_triton.py) check what the kernels compute; this checks that the GPU
compiler accepts them (typing, layouts, register allocation by ptxas), ahead of time, for the
format kinds and dtypes the launchers use. It runs in a subprocess because the kernels must be
defined without TRITON_INTERPRET, which test_triton.py sets.
"""

from __future__ import annotations

import os
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
        dict(OUT_BF16=True, BP=128, **{k: v for k, v in INT4.items() if k not in ("NBND", "MAXV")}),
    ),
    (
        "dequantize_kernel",
        dict(pay_ptr=PTR, sc_ptr="*fp32", val_ptr="*fp32", out_ptr="*fp32", n="i32", nblocks="i32", nbytes="i32"),
        dict(OUT_BF16=False, BP=128, **{k: v for k, v in FP8.items() if k not in ("NBND", "MAXV")}),
    ),
    (
        "rms_norm_quantize_kernel",
        dict(
            x_ptr="*i16", w_ptr="*bf16", h_ptr="*i16", pay_ptr=PTR, sc_ptr="*fp32", bnd_ptr="*fp32", code_ptr=PTR, T="i32", eps="fp32", nbytes="i32"
        ),
        dict(IN_BF16=True, H=4096, HP=4096, RT=1, **INT4),
    ),
    (
        "rms_norm_recompute_kernel",
        dict(pay_ptr=PTR, sc_ptr="*fp32", val_ptr="*fp32", w_ptr="*bf16", h_ptr="*i16", rstd_ptr="*fp32", T="i32", eps="fp32", nbytes="i32"),
        dict(OUT_BF16=True, H=4096, HP=4096, RT=1, **{k: v for k, v in INT4.items() if k not in ("NBND", "MAXV")}),
    ),
    (
        "rms_norm_backward_kernel",
        dict(
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
        ),
        dict(GH_BF16=False, OUT_BF16=True, NEED_GW=True, H=4096, HP=4096, RT=1, **{k: v for k, v in INT4.items() if k not in ("NBND", "MAXV")}),
    ),
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


def compile_all() -> list[str]:
    """Compile every case for sm_90 down to a cubin; one line per case."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from agoq.quant.triton import kernels, ops

    target = GPUTarget("cuda", 90, 32)
    lines = []
    for name, types, consts in CASES:
        fn = getattr(kernels, name)
        if "R" in fn.arg_names:  # blocks per program, as the launchers pick them on a GPU
            consts = dict(consts, R=max(1, ops.GPU_TILE // consts["BP"]))
        missing = [a for a in fn.arg_names if a not in types and a not in consts]
        if missing:
            raise AssertionError(f"{name}: no type or value for {missing}")
        signature = {a: "constexpr" if a in consts else types[a] for a in fn.arg_names}
        src = ASTSource(fn=fn, signature=signature, constexprs=dict(consts))
        compiled = triton.compile(src, target=target, options={"num_warps": 8, "enable_fp_fusion": False})
        if not compiled.asm.get("cubin"):
            raise AssertionError(f"{name}: no cubin")
        lines.append(f"{name} {consts}: {len(compiled.asm['cubin'])} bytes of sm_90 code")
    return lines


def test_every_kernel_compiles_for_sm90() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "src"), env.get("PYTHONPATH", "")])
    code = "from tests.test_triton_compile import compile_all\nprint('\\n'.join(compile_all()))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert len(proc.stdout.strip().splitlines()) == len(CASES), proc.stdout
