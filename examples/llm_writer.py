"""Writer: build a small Llama from a local config (random weights, no downloads),
save it as safetensors, stream the checkpoint into gms and publish it.

    python examples/llm_writer.py --socket /tmp/gms.sock --workdir /tmp/tiny-llama

With RW_OR_RO, a second writer finds the weights published and does nothing.
The config travels as metadata, so readers need nothing from disk.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import gms.torch
from gms import GMSClientMemoryManager, GrantedLockType, RequestedLockType

CONFIG = dict(
    vocab_size=2048, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
    num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512,
)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--socket", required=True)
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    LlamaForCausalLM(LlamaConfig(**CONFIG)).save_pretrained(args.workdir)  # config.json + safetensors

    mgr = GMSClientMemoryManager(args.socket)
    mgr.connect(RequestedLockType.RW_OR_RO)
    if mgr.granted_lock_type is GrantedLockType.RO:
        print("weights already published; nothing to do")
        return
    start = time.perf_counter()
    tensors = gms.torch.load_safetensors(mgr, args.workdir, prefix="model/")
    first = mgr.mappings[0].allocation_id
    with open(f"{args.workdir}/config.json", "rb") as f:
        mgr.metadata_put("config.json", first, 0, f.read())
    mgr.commit()
    print(json.dumps({"published": len(tensors), "seconds": time.perf_counter() - start}))
    mgr.close()


if __name__ == "__main__":
    main()
