"""A reader process for the torch tests: ``python tests/proc_torch.py SOCKET DEVICE PREFIX``.

Builds a Tiny skeleton with meta parameters, materializes it from gms, runs the
fixed input and prints one JSON line: the logits (as a list), whether the tie
survived, and whether every parameter lives inside a gms mapping.
"""

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import gms.torch  # noqa: E402
from gms import GMSClientMemoryManager, RequestedLockType  # noqa: E402
from tests.torch_models import INPUT, Tiny  # noqa: E402


def main() -> None:
    socket_path, device, prefix = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    mgr = GMSClientMemoryManager(socket_path, device=device)
    mgr.connect(RequestedLockType.RO)
    with gms.torch.empty_parameters():
        model = Tiny()
    missing = gms.torch.materialize_module(model, mgr, prefix=prefix)
    spans = [(mp.va, mp.va + mp.size) for mp in mgr.mappings]
    inside = all(any(lo <= p.data_ptr() < hi for lo, hi in spans) for p in model.parameters())
    dev = next(model.parameters()).device
    with torch.no_grad():
        logits = model(INPUT.to(dev)).float().cpu()
    print(json.dumps({
        "logits": logits.flatten().tolist(),
        "tied": model.head.weight is model.embed.weight,
        "inside": inside,
        "missing": missing,
        "device": str(dev),
    }), flush=True)
    mgr.close()


if __name__ == "__main__":
    main()
