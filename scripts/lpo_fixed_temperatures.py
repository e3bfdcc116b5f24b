"""Mean reward of every fixed grid temperature per prompt kind, with 95% confidence intervals (the embedded LPO task's
premise: the best fixed temperature must differ by kind, else adaptive decoding has nothing to learn).

``python scripts/lpo_fixed_temperatures.py --prompts embedded:train --per-kind 10 --samples 3 --out fixed.json``

All temperatures of one prompt are sampled in one batch (rows = temperatures x samples). The interval is a normal
interval over prompts of the per-prompt mean reward (samples of one prompt are not independent); the paired
difference to the best temperature of the other kind is reported per kind.

``--controller EXPORT`` (a sequence-level adaptive-temperature export) also scores the adaptive decoder AD_seq on the
same samples: its greedy choice from the prompt's last hidden state picks one temperature per prompt, and sampling at
that temperature has exactly the law of the fixed-temperature rows of that prompt, so the reward of those rows is an
unbiased, paired estimate of the adaptive decoder's reward (mean chosen temperature per kind reported too).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import torch


class FixedRows:
    """A stand-in controller whose choice is a fixed temperature index per batch row."""

    def __init__(self, indices: torch.Tensor) -> None:
        self.indices = indices

    def choose(self, hidden: torch.Tensor, mode: str, generator: torch.Generator | None = None) -> torch.Tensor:
        return self.indices


def ci(values: list[float]) -> tuple[float, float]:
    """(mean, half-width of the 95% normal interval)."""
    n = len(values)
    mean = sum(values) / n
    var = sum((v - mean) ** 2 for v in values) / max(n - 1, 1)
    return mean, 1.96 * math.sqrt(var / n)


def main(argv: list[str] | None = None) -> int:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from draftsmith import assets
    from draftsmith.common.chat import encode_chat
    from draftsmith.controllers.adaptive_temperature import DEFAULT_GRID
    from draftsmith.runtime.tools.mixed_task import load_prompt_records
    from draftsmith.runtime.tools.rewards import load_reward, score
    from draftsmith.runtime.tools.rollouts import sample_group

    p = argparse.ArgumentParser()
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--prompts", default="embedded:train")
    p.add_argument("--per-kind", type=int, default=10)
    p.add_argument("--kinds", default=None, help="comma-separated kinds to measure (default: all)")
    p.add_argument("--samples", type=int, default=3)
    p.add_argument("--max-new-tokens", default="arithmetic=10,copy=8,continue=32,default=32")
    p.add_argument("--reward", default="embedded")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=None)
    p.add_argument("--controller", default=None, help="sequence-level adaptive-temperature export to score")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    budget = dict(kv.split("=") for kv in args.max_new_tokens.split(","))
    path = assets.resolve_target(args.target)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    reward = load_reward(args.reward)
    grid = DEFAULT_GRID
    records, seen = [], {}
    for r in load_prompt_records(args.prompts):
        if args.kinds and r["kind"] not in args.kinds.split(","):
            continue
        if seen.get(r["kind"], 0) < args.per_kind:
            seen[r["kind"]] = seen.get(r["kind"], 0) + 1
            records.append(r)
    head = None
    if args.controller:
        from draftsmith.controllers.adaptive_temperature import AdaptiveTemperatureHead

        head, _ = AdaptiveTemperatureHead.from_export(args.controller)
        if head.config.granularity != "sequence" or tuple(head.config.grid) != tuple(grid):
            raise SystemExit("--controller must be a sequence-level export on the default grid")
    rows = torch.arange(len(grid)).repeat_interleave(args.samples)  # [K * S]
    per = {}  # kind -> temperature index -> per-prompt mean rewards
    adaptive = {}  # kind -> [(chosen temperature, reward at it)]
    prompts_out = []
    start = time.perf_counter()
    for i, r in enumerate(records):
        gen = torch.Generator().manual_seed(i)
        group = sample_group(model, encode_chat(tok, r["text"]), len(rows), grid, "sequence", FixedRows(rows),
                             int(budget.get(r["kind"], budget["default"])), [tok.eos_token_id], gen)
        values = [score(reward, r, tok.decode(t, skip_special_tokens=True)) for t, _ in group]
        means = []
        for k in range(len(grid)):
            chunk = values[k * args.samples:(k + 1) * args.samples]
            means.append(sum(chunk) / len(chunk))
            per.setdefault(r["kind"], {}).setdefault(k, []).append(means[-1])
        prompts_out.append({"id": r["id"], "kind": r["kind"], "mean_by_temperature": [round(m, 4) for m in means]})
        if head is not None:
            with torch.no_grad():
                out = model.model(input_ids=torch.tensor([encode_chat(tok, r["text"])]))
                choice = int(head.choose(out.last_hidden_state[0, -1], "greedy"))
            adaptive.setdefault(r["kind"], []).append((grid[choice], means[choice]))
        print(f"{i + 1}/{len(records)} {r['kind']} {time.perf_counter() - start:.0f}s", file=sys.stderr)
    result = {"grid": list(grid), "samples_per_prompt": args.samples, "seconds": round(time.perf_counter() - start),
              "kinds": {}}
    for kind, by_t in per.items():
        stats = {str(grid[k]): dict(zip(("mean", "ci95"), map(lambda x: round(x, 4), ci(v)))) for k, v in by_t.items()}
        best = max(by_t, key=lambda k: sum(by_t[k]))
        result["kinds"][kind] = {"prompts": len(by_t[0]), "by_temperature": stats, "best": grid[best]}
    for kind, info in result["kinds"].items():  # paired: this kind's best vs the other kinds' best temperature
        for other, oinfo in result["kinds"].items():
            if other != kind and oinfo["best"] != info["best"]:
                a, b = per[kind][grid.index(info["best"])], per[kind][grid.index(oinfo["best"])]
                m, h = ci([x - y for x, y in zip(a, b)])
                info[f"best_minus_T{oinfo['best']}"] = {"mean": round(m, 4), "ci95": round(h, 4)}
    if head is not None:
        overall = [v for pairs in adaptive.values() for _, v in pairs]
        result["adaptive_seq"] = {"mean": dict(zip(("mean", "ci95"), map(lambda x: round(x, 4), ci(overall)))),
                                  "kinds": {k: {"reward": round(sum(v for _, v in pairs) / len(pairs), 4),
                                                "mean_temperature": round(sum(t for t, _ in pairs) / len(pairs), 3)}
                                            for k, pairs in adaptive.items()}}
        result["fixed_overall"] = {str(grid[k]): round(sum(sum(per[kind][k]) for kind in per) /
                                                       sum(len(per[kind][k]) for kind in per), 4)
                                   for k in range(len(grid))}
    result["prompts"] = prompts_out
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
