"""examples/moe_layer.py: one MoE layer through fabric_lib.ep against a dense reference.

On a machine with CUDA GPUs the example itself runs (two ranks; bf16 and fp8 dispatch; one node
and two one-GPU nodes through the proxies); FABRIC_EP_TEST_DEVICES=0,0 puts both ranks on one
GPU, as in test_ep.py. Elsewhere (CI has no GPU) those are skipped with the reason, and the
example's reference is checked on the CPU against a per-token loop.
"""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

import fabric_lib

torch = pytest.importorskip("torch")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "moe_layer.py"
DEVICES = os.environ.get("FABRIC_EP_TEST_DEVICES", "0,1")
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                "NVSHMEM_DISABLE_NVLS": "1"}


def gpu_count():
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


needs_gpus = pytest.mark.skipif(
    not fabric_lib.HAS_CUDA or gpu_count() <= max(int(d) for d in DEVICES.split(",")),
    reason=f"needs fabric_lib built with CUDA (HAS_CUDA={fabric_lib.HAS_CUDA}) and GPUs "
    f"{DEVICES} (torch sees {gpu_count()}; FABRIC_EP_TEST_DEVICES=0,0 for one GPU); CI has none",
)


@needs_gpus
@pytest.mark.parametrize("dtype", [
    "bf16",
    pytest.param("fp8", marks=pytest.mark.skipif(
        not hasattr(torch, "float8_e4m3fn"), reason=f"torch {torch.__version__} has no fp8")),
])
@pytest.mark.parametrize("nodes", [[], ["--two-nodes"]], ids=["one_node", "two_nodes"])
def test_the_example_matches_the_dense_reference(dtype, nodes):
    run = subprocess.run([sys.executable, str(EXAMPLE), "--devices", DEVICES, "--dtype", dtype,
                          *nodes], capture_output=True, text=True, timeout=180,
                         env={**os.environ, **NO_MULTICAST})
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    assert run.stdout.splitlines()[-1] == "OK", run.stdout
    assert run.stdout.count(", OK") == len(DEVICES.split(",")), run.stdout  # every rank's line


def load_example():
    spec = importlib.util.spec_from_file_location("moe_layer", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # defines functions only: main() runs under __main__
    return module


def test_the_examples_reference_is_the_per_token_weighted_sum():
    """Everywhere (CPU): route() picks top-k with weights summing to 1, and reference() equals
    sum_k w[t, k] * x[t] @ W[idx[t, k]] computed token by token."""
    ex = load_example()
    router, expert_w = ex.make_layer(64, 8, "cpu")
    x = torch.randn(10, 64, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    idx, w = ex.route(x, router, 3)
    assert idx.shape == (10, 3) and idx.dtype == torch.int64 and w.dtype == torch.float32
    torch.testing.assert_close(w.sum(-1), torch.ones(10))
    assert all(len(set(row)) == 3 for row in idx.tolist())  # distinct experts per token
    # Each expert's product in fp32, rounded to bf16 as the bf16 matmul's output is.
    y = lambda t, e: (x[t].float() @ expert_w[e].float()).to(torch.bfloat16).float()
    want = torch.stack([sum(w[t, k] * y(t, idx[t, k]) for k in range(3)) for t in range(10)])
    torch.testing.assert_close(ex.reference(x, idx, w, expert_w).float(), want, rtol=2e-2,
                               atol=2e-2)
