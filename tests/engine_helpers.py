"""Real engines for the failover tests: a tiny Llama checkpoint, gms servers
per rank, engine processes, and an HTTP client."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx

from gms.client.probes import get_runtime_state, iter_event_history
from gms.errors import GMSError

from .helpers import kill_tree, wait_until

ROOT = Path(__file__).resolve().parent.parent
ENGINE = str(ROOT / "examples" / "engine")
TINY = dict(  # a Llama small enough to start in well under a second on 2 cores
    vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    bos_token_id=1, eos_token_id=2,
)
PROMPT = [1, 17, 30, 5, 99]
CORPUS = ["the shadow engine wakes when the primary fails",
          "weights stay in gpu memory while engines come and go"] * 4


def make_tiny_model(folder: Path, seed: int = 0) -> Path:
    """config.json, model.safetensors (random weights) and a tokenizer trained here.

    Written with torch, safetensors and tokenizers alone: importing transformers
    costs seconds that the test process would spend before any engine starts.
    The names and shapes are a Llama's; the engine refuses a checkpoint that
    does not fit its transformers model (materialize_module is strict).
    """
    import torch
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    c = TINY
    folder.mkdir(parents=True, exist_ok=True)
    hidden, inter, heads, kv = c["hidden_size"], c["intermediate_size"], c["num_attention_heads"], c["num_key_value_heads"]
    head_dim = hidden // heads
    shapes = {"model.embed_tokens.weight": (c["vocab_size"], hidden), "model.norm.weight": (hidden,),
              "lm_head.weight": (c["vocab_size"], hidden)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": (heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": (kv * head_dim, hidden),
            p + "self_attn.v_proj.weight": (kv * head_dim, hidden),
            p + "self_attn.o_proj.weight": (hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": (inter, hidden), p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
            p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,),
        })
    generator = torch.Generator().manual_seed(seed)
    tensors = {name: (1 + 0.1 * torch.randn(shape, generator=generator)) if len(shape) == 1
               else 0.1 * torch.randn(shape, generator=generator) for name, shape in shapes.items()}
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "dtype": "float32",
              "hidden_act": "silu", "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "head_dim": head_dim, **c}
    (folder / "config.json").write_text(json.dumps(config))

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=c["vocab_size"], special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}))
    return folder


_MODEL: dict[str, object] = {}


def tiny_model(tmp_path_factory) -> Path:
    """One tiny checkpoint per test session."""
    if "folder" not in _MODEL:
        _MODEL["folder"] = make_tiny_model(tmp_path_factory.mktemp("tiny-llama"))
    return _MODEL["folder"]


def reference(tmp_path_factory) -> list[int]:
    """The greedy tokens transformers itself decodes after PROMPT (computed once;
    call it after starting engines, so its imports overlap their start)."""
    if "tokens" not in _MODEL:
        _MODEL["tokens"] = reference_tokens(tiny_model(tmp_path_factory), PROMPT, 6)
    return _MODEL["tokens"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RankServers:
    """The gms server of one rank (host backend)."""

    def __init__(self, folder: Path, name: str, *extra: str) -> None:
        self.socket = str(folder / f"gms_{name}.sock")
        log = open(folder / f"server-{name}.log", "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gms", "serve", "--backend", "host", "--socket", self.socket,
             "--log-level", "warning", *extra],
            stdout=log, stderr=subprocess.STDOUT,
        )
        wait_until(self._ready, timeout=30, what="gms server")

    def _ready(self) -> bool:
        assert self.proc.poll() is None, "the gms server exited"
        try:
            get_runtime_state(self.socket, timeout=1)
        except GMSError:
            return False
        return True

    def state(self, layout: str):
        """The layout's row of the server's state."""
        return get_runtime_state(self.socket).layout(layout)

    def events(self):
        return list(iter_event_history(self.socket))

    def stop(self) -> None:
        """SIGKILL the keeper and its server together (a server whose keeper alone
        died would start another: gms.server.restart.succession.find_keeper)."""
        if self.proc.poll() is None:
            kill_tree(self.proc.pid)
            self.proc.wait()


def engine_argv(model: Path, gms_socket: str, port: int, *extra: str) -> list[str]:
    return [sys.executable, ENGINE, "--model", str(model), "--gms-socket", gms_socket,
            "--port", str(port), "--max-seq-len", "64", *extra]


class EngineProcess:
    def __init__(self, model: Path, gms_socket: str, log: Path, mode: str = "primary", *extra: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log
        env = {**os.environ, "GMS_MODE": mode, "ENGINE_LOG_LEVEL": "WARNING"}
        self._log = open(log, "wb")
        self.proc = subprocess.Popen(engine_argv(model, gms_socket, self.port, *extra), env=env,
                                     stdout=self._log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 60) -> dict:
        def ready():
            assert self.proc.poll() is None, f"engine exited:\n{self.log}"
            try:
                state = httpx.get(f"{self.url}/state", timeout=2).json()
            except httpx.HTTPError:
                return None
            return state if state["phase"] in ("serving", "asleep") else None
        return wait_until(ready, timeout=timeout, interval=0.1, what=f"engine on {self.url}")

    @property
    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            if sig in (signal.SIGKILL, signal.SIGTERM):
                self.proc.wait(30)


def complete(url: str, prompt, max_tokens: int = 4, timeout: float = 30, **extra) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens, **extra},
                      timeout=timeout)


def reference_tokens(model_dir: Path, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens from a plain transformers load, recomputing the whole sequence each step."""
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir).eval()
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def read_json_lines(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def wait_http(predicate, timeout: float, what: str):
    def attempt():
        try:
            return predicate()
        except httpx.HTTPError:
            return None
    return wait_until(attempt, timeout=timeout, interval=0.05, what=what)


__all__ = ["PROMPT", "EngineProcess", "RankServers", "complete", "free_port", "make_tiny_model",
           "read_json_lines", "reference", "reference_tokens", "tiny_model", "wait_http"]
