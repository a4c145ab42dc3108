"""Calibrate the plan's throughput model on this machine.

Times the kernels spap's stages are made of, at the sizes of a small model's layer, and writes
their rates into ``spap_lib/throughput.json`` under ``--name`` (the committed entry is this 2-core
machine's; GPU entries there are spec-sheet assumptions until measured on a GPU with this script).

    python bench/throughput.py --name cpu-2core
"""
from __future__ import annotations

import argparse
import json
import platform
import time

import torch

from spap_lib.artifact.manifest import device_name, git_revision
from spap_lib.files import REPO, write_json_atomic

TABLE = REPO / "spap_lib" / "throughput.json"


def rate(fn, flops: float, repeats: int = 5) -> float:
    fn()  # warm-up
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return flops * repeats / (time.perf_counter() - t0)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--name", required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--n", type=int, default=1536, help="MLP width of the timed layer")
    ap.add_argument("--d", type=int, default=576, help="hidden size of the timed layer")
    args = ap.parse_args(argv)
    dev, n, d, N = torch.device(args.device), args.n, args.d, 8192
    out = {}
    for name, dtype in (("matmul_fp32", torch.float32), ("matmul_bf16", torch.bfloat16)):
        a, b = torch.randn(N, d, device=dev, dtype=dtype), torch.randn(d, n, device=dev, dtype=dtype)
        out[name] = rate(lambda: a @ b, 2 * N * d * n)
    if dev.type == "cuda":  # float32 products on TF32 tensor cores (precision="tf32")
        a, b = torch.randn(N, d, device=dev), torch.randn(d, n, device=dev)
        torch.backends.cuda.matmul.allow_tf32 = True
        out["matmul_tf32"] = rate(lambda: a @ b, 2 * N * d * n)
        torch.backends.cuda.matmul.allow_tf32 = False
    for name, dtype in (("cholesky_fp64", torch.float64), ("cholesky_fp32", torch.float32)):
        z = torch.randn(n, 4 * n, device=dev, dtype=dtype)
        A = z @ z.T + n * torch.eye(n, device=dev, dtype=dtype)
        rhs = torch.randn(n, d, device=dev, dtype=dtype)
        out[name] = rate(lambda: torch.cholesky_solve(rhs, torch.linalg.cholesky(A)), n**3 / 3 + 2 * n * n * d)
    table = json.loads(TABLE.read_text()) if TABLE.is_file() else {}
    memory = {"memory_gb": round(torch.cuda.get_device_properties(dev).total_memory / 2**30)} \
        if dev.type == "cuda" else {k: v for k, v in table.get(args.name, {}).items() if k == "memory_gb"}
    table[args.name] = {"flops_per_second": {k: round(v) for k, v in out.items()}, **memory, "source": "measured",
                        "command": f"python bench/throughput.py --name {args.name} --device {args.device} "
                                   f"--n {n} --d {d}",
                        "machine": f"{platform.machine()}, {device_name(dev)}",
                        "revision": git_revision()}
    write_json_atomic(TABLE, table)
    print(json.dumps(table[args.name], indent=1))


if __name__ == "__main__":
    main()
