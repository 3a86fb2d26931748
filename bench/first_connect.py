"""First connect in a fresh process: from ``connect()`` to a 16 GB model usable.

An engine-like process starts with torch and CUDA initialised (an engine has
both before it asks for weights), imports gms as a user does (``import gms,
gms.torch``: nothing of gms's CUDA code loaded by hand), creates its manager
(timed apart: process set-up, where gms pays its one-time costs: the fd
table, the CUDA bindings' import), then times ``connect(RO)`` and
``import_tensors`` of a committed Llama-3-8B-shaped model (291 bf16 tensors,
16.06 GB, packed into 1 GiB allocations by ``publish_tensors``), until
``torch.cuda.synchronize()`` returns.  Each repeat is a new process.

    python bench/first_connect.py [--repeats 5] [--compare /tmp/gms-before]

``--compare TREE`` runs the readers of another commit's tree too (same server,
same run, interleaved), for a before/after table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import Server, cpu_name, print_table, run_json, write_json  # noqa: E402

WRITER = r"""
import json, sys, time, torch
from gms import GMSClientMemoryManager
import gms.torch
hidden, inter, kv, vocab = 4096, 14336, 1024, 128256
layer = [("input_layernorm", (hidden,)), ("q_proj", (hidden, hidden)), ("k_proj", (kv, hidden)),
         ("v_proj", (kv, hidden)), ("o_proj", (hidden, hidden)), ("post_attention_layernorm", (hidden,)),
         ("gate_proj", (inter, hidden)), ("up_proj", (inter, hidden)), ("down_proj", (hidden, inter))]
shapes = [("embed", (vocab, hidden))] + [(f"l{i}.{n}", s) for i in range(32) for n, s in layer]
shapes += [("norm", (hidden,)), ("lm_head", (vocab, hidden))]
mgr = GMSClientMemoryManager(sys.argv[1], device=0)
mgr.connect("RW")
def tensors():
    for name, shape in shapes:
        yield name, torch.empty(shape, dtype=torch.bfloat16, device="cuda").uniform_()
count = gms.torch.publish_tensors(mgr, tensors())
mgr.commit()
print(json.dumps({"tensors": count, "bytes": sum(2 * torch.Size(s).numel() for _, s in shapes)}))
"""

READER = r"""
import json, sys, time, torch
torch.cuda.init(); torch.empty(1, device="cuda"); torch.cuda.synchronize()
import gms, gms.torch
t = time.perf_counter()
mgr = gms.GMSClientMemoryManager(sys.argv[1], device=0)
manager_s = time.perf_counter() - t
t0 = time.perf_counter()
mgr.connect("RO")
t1 = time.perf_counter()
tensors = gms.torch.import_tensors(mgr)
torch.cuda.synchronize()
t2 = time.perf_counter()
print(json.dumps({"manager_s": manager_s, "connect_s": t1 - t0, "materialize_s": t2 - t1,
                  "total_s": t2 - t0, "tensors": len(tensors), "allocations": len(mgr.mappings)}))
"""


def reader(socket: str, tree: str | None) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([tree, os.environ.get("PYTHONPATH", "")])} if tree else None
    out = subprocess.run([sys.executable, "-c", READER, socket], env=env, capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise RuntimeError(f"reader failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def median(rows: list[dict], key: str) -> float:
    return sorted(r[key] for r in rows)[len(rows) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--compare", metavar="TREE", help="another commit's tree: its readers too, interleaved")
    parser.add_argument("--json", default="bench/results/first_connect.json")
    args = parser.parse_args()
    trees = {"after": None} if not args.compare else {"before": args.compare, "after": None}
    with tempfile.TemporaryDirectory() as directory, Server(directory, "cuda", "first") as server:
        model = run_json(WRITER, server.socket, timeout=600)
        runs: dict[str, list] = {label: [] for label in trees}
        for _ in range(args.repeats):
            for label, tree in trees.items():
                runs[label].append(reader(server.socket, tree))
    keys = ("manager_s", "connect_s", "materialize_s", "total_s")
    rows = [(label, *(f"{median(r, k) * 1e3:.1f}" for k in keys), f"{min(x['total_s'] for x in r) * 1e3:.1f}")
            for label, r in runs.items()]
    print_table(f"a fresh process: connect(RO) + import_tensors of {model['bytes'] / 1e9:.2f} GB "
                f"({model['tensors']} tensors), ms, median of {args.repeats}",
                rows, header=("tree", "manager", "connect", "materialize", "connect+materialize", "best"))
    write_json(args.json, {"cpu": cpu_name(), "model": model, "repeats": args.repeats,
                           "before_tree": args.compare, **runs})


if __name__ == "__main__":
    main()
