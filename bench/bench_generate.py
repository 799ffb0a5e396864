"""Greedy generation through the transformers integration beside sdpa, in one process: a small
random-init Llama (hidden 256, GQA 8/2 heads of d=32, `--layers` layers; `--hidden`, `--heads`,
`--kv-heads`, `--head-dim` for larger ones) on a left-padded batch
of `--batch` prompts of `--prompt` tokens, `--new` tokens each; both models hold the same
weights and must produce the same tokens. Prints milliseconds per generated token (medians of
`--repeats` alternating runs) and sdpa / attncc, then the prefill (the prompt's forward) and a
decoding step (the median step) timed apart by a streamer's timestamps, so that a long
prompt's prefill does not pass for decoding speed, and the time of each layer's attention call in
the decoding steps (medians; the step's first layer call apart from the others: it takes a new
key count), which is steadier than the steps' on a noisy machine. What the default sizes show is
the host time of decoding steps: every layer's call with the padding's key ranges (`kv_start`,
`kv_end`) and a key more each step, at sizes where the kernels take tens of microseconds.

With `--compile` both models run transformers' recipe for fast generation: a static cache and
`torch.compile(model.forward, fullgraph=True)` (compiled before the timed runs).

    python bench/bench_generate.py [--layers 8 --batch 4 --prompt 200 --new 64 --repeats 5] [--compile] [--json FILE]
        [--hidden 256 --heads 8 --kv-heads 2 --head-dim 32]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from attncc.integrations import transformers as integration  # noqa: E402
from bench.bench_cpu import cpu_meta  # noqa: E402

NAME = "attncc-bench"


class TokenClock:
    """A `generate` streamer that notes when each batch of tokens comes: the prompt's (before the
    prefill), then each generated token's, so the prefill and every decoding step are timed
    apart (the difference of two runs, one of a single token, was drowned by the prefill's own
    noise at long prompts)."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        del value
        self.stamps.append(time.perf_counter())

    def end(self) -> None:
        pass


class CallClock:
    """Times every decoding call (a query of one token) of the attention functions of `names`
    in transformers' registry, wrapped in place: the step's first layer call apart from the
    others (`layers` calls a step; `restart` before each generation)."""

    def __init__(self, names: tuple[str, ...], layers: int) -> None:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        self.layers, self.current, self.count = layers, "", 0
        self.times: dict[tuple[str, bool], list[float]] = {
            (name, first): [] for name in names for first in (True, False)
        }
        for name in names:
            ALL_ATTENTION_FUNCTIONS[name] = self._timed(name, ALL_ATTENTION_FUNCTIONS[name])

    def _timed(self, name: str, function: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if args[1].shape[2] != 1 or self.current != name:  # (query [B, H, N, D]: the prefill's, or untimed)
                return function(*args, **kwargs)
            first = self.count % self.layers == 0
            self.count += 1
            began = time.perf_counter()
            result = function(*args, **kwargs)
            self.times[(name, first)].append(time.perf_counter() - began)
            return result

        return timed

    def restart(self, name: str) -> None:
        """Time `name`'s calls from the next generation's first step on."""
        self.current, self.count = name, 0

    def medians_us(self) -> dict[str, dict[str, float]]:
        """Per name, the medians in microseconds of the steps' first calls and of the others."""
        names = dict.fromkeys(name for name, _ in self.times)
        return {
            name: {kind: statistics.median(self.times[(name, kind == "first")]) * 1e6 for kind in ("first", "others")}
            for name in names
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=200)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=256, help="hidden size (the MLP's is twice it)")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--compile", action="store_true", help="static caches, forwards compiled with fullgraph=True")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.new < 2:  # (a decoding step is the time between two generated tokens)
        parser.error(f"--new: at least 2 tokens, to time a decoding step; got {args.new}")
    import transformers

    integration.register(NAME)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=512, hidden_size=args.hidden, intermediate_size=2 * args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
        max_position_embeddings=args.prompt + args.new + 8,
    )  # fmt: skip
    models = {
        name: transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=name).eval()
        for name in ("sdpa", NAME)
    }
    models[NAME].load_state_dict(models["sdpa"].state_dict())
    ids = torch.randint(1, cfg.vocab_size, (args.batch, args.prompt))
    mask = torch.ones_like(ids)
    for row in range(args.batch):  # left padding, as generation pads: 0, 37, 74, ... tokens
        mask[row, : (37 * row) % max(args.prompt // 2, 1)] = 0
    options = dict(
        attention_mask=mask, max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False, pad_token_id=0
    )
    if args.compile:
        options["cache_implementation"] = "static"
        for model in models.values():
            model.forward = torch.compile(model.forward, fullgraph=True)
    times: dict[str, list[float]] = {name: [] for name in models}
    prefills: dict[str, list[float]] = {name: [] for name in models}
    steps: dict[str, list[float]] = {name: [] for name in models}
    calls = CallClock(tuple(models), args.layers)
    with torch.inference_mode():
        tokens = {name: model.generate(ids, **options) for name, model in models.items()}  # (and warm)
        if not torch.equal(tokens["sdpa"], tokens[NAME]):
            raise SystemExit("attncc's tokens differ from sdpa's")
        for _ in range(args.repeats):
            for name, model in models.items():
                clock = TokenClock()
                calls.restart(name)
                began = time.perf_counter()
                model.generate(ids, streamer=clock, **options)
                times[name].append((time.perf_counter() - began) / args.new * 1e3)
                prefills[name].append((clock.stamps[1] - clock.stamps[0]) * 1e3)
                steps[name].append(statistics.median(b - a for a, b in zip(clock.stamps[1:], clock.stamps[2:])) * 1e3)
        calls.restart("")
    ms = {name: statistics.median(values) for name, values in times.items()}
    prefill_ms = {name: statistics.median(values) for name, values in prefills.items()}
    step_ms = {name: statistics.median(values) for name, values in steps.items()}
    meta = {**cpu_meta(), "torch": torch.__version__, "transformers": transformers.__version__, **vars(args)}
    meta.pop("json")
    print(f"{meta['cpu_model']} ({meta['cpu_family_model']}), torch {torch.__version__}: ms per generated token")
    print(f"sdpa {ms['sdpa']:.2f}  attncc {ms[NAME]:.2f}  sdpa / attncc {ms['sdpa'] / ms[NAME]:.2f}")
    print(
        f"prefill: sdpa {prefill_ms['sdpa']:.2f}  attncc {prefill_ms[NAME]:.2f} ms ({prefill_ms['sdpa'] / prefill_ms[NAME]:.2f}); "
        f"a decoding step: sdpa {step_ms['sdpa']:.2f}  attncc {step_ms[NAME]:.2f} ms ({step_ms['sdpa'] / step_ms[NAME]:.2f})"
    )
    call_us = calls.medians_us()
    print(
        "attention per layer call in decoding steps (medians): the step's first "
        f"sdpa {call_us['sdpa']['first']:.0f}  attncc {call_us[NAME]['first']:.0f} us, the others "
        f"sdpa {call_us['sdpa']['others']:.0f}  attncc {call_us[NAME]['others']:.0f} us"
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        result = {"ms_per_token": ms, "prefill_ms": prefill_ms, "ms_per_step": step_ms, "us_per_layer_call": call_us}
        runs = {"per_token": times, "prefill": prefills, "per_step": steps}
        args.json.write_text(json.dumps({"meta": meta, **result, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
