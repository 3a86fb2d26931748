"""Reader: import the published model from gms (no disk) and generate.

    python examples/llm_reader.py --socket /tmp/gms.sock [--tokens 16] [--logits out.pt]

Prints the generated token ids and how long the import took; ``--logits``
saves the logits of a fixed prompt for comparison.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import gms.torch
from gms import GMSClientMemoryManager, RequestedLockType

PROMPT = [[1, 17, 301, 5, 99, 1024, 7, 3]]


def import_model(mgr: GMSClientMemoryManager):
    _, _, raw_config = mgr.metadata_get("config.json")
    config = LlamaConfig(**json.loads(raw_config))
    with gms.torch.empty_parameters():  # parameters on meta: no memory, no init
        model = AutoModelForCausalLM.from_config(config)
    gms.torch.materialize_module(model, mgr, prefix="model/")
    return model.eval()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--socket", required=True)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--logits")
    args = parser.parse_args()

    mgr = GMSClientMemoryManager(args.socket)
    start = time.perf_counter()
    mgr.connect(RequestedLockType.RO)
    model = import_model(mgr)
    imported = time.perf_counter() - start
    device = next(model.parameters()).device
    prompt = torch.tensor(PROMPT, device=device)
    with torch.no_grad():
        logits = model(prompt).logits
        generated = model.generate(prompt, max_new_tokens=args.tokens, do_sample=False)
    if args.logits:
        torch.save(logits.cpu(), args.logits)
    print(json.dumps({"import_seconds": imported, "tokens": generated[0, len(PROMPT[0]):].tolist(),
                      "device": str(device)}))
    mgr.close()


if __name__ == "__main__":
    main()
