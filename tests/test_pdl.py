"""Programmatic dependent launch (kernels/pdl.py) where no GPU runs it: each kernel that takes
it compiles with it for a Hopper card (Triton compiles for a named target on the CPU), and its
PTX waits, and lets the next kernel launch, where pdl.py says: a short kernel right after its
wait, a GEMV after its weights are read, and the CUDA cores' GEMV reads its first block of
weights before its wait. The interpreter never takes this path, so without this a typo in it
would first show on a GPU. The compiles run in a process of their own, without the
interpreter that the other tests may have switched on."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

WAIT, RELEASE = "griddepcontrol.wait", "griddepcontrol.launch_dependents"
COMPILE = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
try:
    from triton.language.extra.cuda import gdc_wait  # triton >= 3.4
except ImportError:
    print(json.dumps(None)); sys.exit()
from minisgl.kernels.elementwise import _rmsnorm_kernel
from minisgl.kernels.gemv import _gemv_kernel
try:  # chapter 26's: a chapter before it has no tensor cores' GEMV
    from minisgl.kernels.gemv_mma import _mma_gemv_kernel
except ImportError:
    _mma_gemv_kernel = None

POINTERS = {"X", "W", "Y", "BIAS", "R", "R_OUT", "NW"}

def ptx(kernel, constants):
    signature = {n: "constexpr" if n in constants else "*bf16" if n in POINTERS
                 else "fp32" if n == "eps" else "i32" for n in kernel.arg_names}
    src = ASTSource(kernel, signature, constants)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ptx"]

gemv = dict(BLOCK_M=1, BLOCK_N=2, BLOCK_K=512, HAS_BIAS=False, NORM=True)
mma = dict(BLOCK_N=16, BLOCK_K=256, HAS_BIAS=False, GATED=True, NORM=True, EVEN_K=True,
           PRECISION="tf32", PDL=True)
found = {
    "gemv": ptx(_gemv_kernel, dict(gemv, GATED=False, PDL=True)),
    "gemv gated": ptx(_gemv_kernel, dict(gemv, GATED=True, PDL=True)),
    "gemv plain": ptx(_gemv_kernel, dict(gemv, GATED=True, PDL=False)),
    "norm": ptx(_rmsnorm_kernel, dict(BLOCK=1024, ADD=True, PDL=True)),
}
if _mma_gemv_kernel is not None:
    found["mma"] = ptx(_mma_gemv_kernel, mma)
print(json.dumps(found))
"""


@pytest.fixture(scope="module")
def ptx() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, "-c", COMPILE], capture_output=True, text=True, env=env, timeout=300
    )
    if run.returncode != 0:
        if "ptxas" in run.stderr or "GPUTarget" in run.stderr:  # pragma: no cover
            pytest.skip(f"Triton cannot compile for sm_90 here: {run.stderr[-300:]}")
        raise AssertionError(run.stderr[-2000:])
    found = json.loads(run.stdout.splitlines()[-1])
    if found is None:  # pragma: no cover - an older Triton: PDL is never taken
        pytest.skip("this Triton has no programmatic dependent launch")
    return found


@pytest.mark.parametrize("kind", ["gemv", "gemv gated"])
def test_the_gemv_loads_weights_before_its_wait_and_releases_after(ptx, kind: str) -> None:
    code = ptx[kind]
    assert code.count(WAIT) == 1 and code.count(RELEASE) == 1
    wait, release = code.index(WAIT), code.index(RELEASE)
    assert code.index("ld.global") < wait < release  # the first weights come before the wait
    assert "st.global" not in code[:wait]  # and nothing is written before it
    assert WAIT not in ptx["gemv plain"] and RELEASE not in ptx["gemv plain"]


def test_the_tensor_cores_gemv_waits_first_and_releases_after_its_products(ptx) -> None:
    if "mma" not in ptx:
        pytest.skip("no tensor cores' GEMV in this tree (chapter 26 brings it)")
    code = ptx["mma"]
    wait, release = code.index(WAIT), code.index(RELEASE)
    assert "ld.global" not in code[:wait] and "cp.async" not in code[:wait]
    assert wait < release and "mma.sync" in code[wait:release]


def test_a_norm_releases_right_after_its_wait(ptx) -> None:
    code = ptx["norm"]
    wait, release = code.index(WAIT), code.index(RELEASE)
    assert wait < release and "ld.global" not in code[:release]
