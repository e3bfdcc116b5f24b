"""One prompt loader, one grammar (common/prompt_sets.py): every spelling a command accepts
(``mtbench``, ``humaneval``, ``sharegpt``, a .jsonl or .txt file, each with an optional ``[a:b]``)
resolves to the same prompts from each caller (bench and evaluations, the diffusion bench,
``draftsmith trajectories``), and a spec that names nothing is refused in one line by each."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from draftsmith import assets
from draftsmith.bench.prompts import load_prompts
from draftsmith.cli import main
from draftsmith.common.chat import encode_chat
from draftsmith.common.errors import DraftsmithError
from draftsmith.common.prompt_sets import check_spec, encode_prompts, prompt_texts
from draftsmith.datagen import trajectories
from draftsmith.evals.diffusion import _bench_prompts
from draftsmith.runtime.target import diffusion_lm

pytestmark = pytest.mark.unit

QUESTIONS = ["hello world", "why is the sky blue ?", "explain python", "hello"]


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    """The same four prompts as a .jsonl (``prompt`` and MT-Bench ``turns`` lines mixed) and as a
    .txt (one per line, blank lines skipped)."""
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text(
        "".join(
            json.dumps({"prompt": q} if i % 2 else {"turns": [q, "and then ?"]}) + "\n\n"
            for i, q in enumerate(QUESTIONS)
        )
    )
    txt = tmp_path / "p.txt"
    txt.write_text("".join(f"{q}\n\n" for q in QUESTIONS))
    return {"jsonl": jsonl, "txt": txt}


def expected_texts(spec: str, files: dict[str, Path]) -> list[str]:
    """What each spelling means, written out from the sources themselves."""
    first_turns = [q["turns"][0] for q in assets.mtbench_questions()]
    sharegpt, _ = assets.read_sharegpt(assets.sharegpt_path(), limit=3)
    return {
        "mtbench": first_turns,
        "mtbench[40:43]": first_turns[40:43],
        "humaneval[:2]": assets.humaneval_prompts()[:2],
        "sharegpt[:3]": [c["conversations"][0]["value"] for c in sharegpt],
        "{jsonl}": QUESTIONS,
        "{txt}": QUESTIONS,
        "{jsonl}[1:3]": QUESTIONS[1:3],
        "{txt}[2:]": QUESTIONS[2:],
    }[spec]


SPELLINGS = [
    "mtbench",
    "mtbench[40:43]",
    "humaneval[:2]",
    "sharegpt[:3]",
    "{jsonl}",
    "{txt}",
    "{jsonl}[1:3]",
    "{txt}[2:]",
]


def trajectories_prompts(spec: str, tokenizer, monkeypatch, tmp_path) -> list[list[int]]:
    """The prompt ids ``draftsmith trajectories`` decodes for ``spec`` (model load and decoding
    replaced: only the prompt path runs)."""
    fake = SimpleNamespace(tokenizer=tokenizer, spec=SimpleNamespace(block_length=4))
    monkeypatch.setattr(diffusion_lm, "load_diffusion_lm", lambda *a, **k: fake)
    monkeypatch.setattr(diffusion_lm, "supports_prefix_cache", lambda spec: False)
    seen = {}

    def capture(lm, prompts, out, cfg, **kwargs):
        seen["prompts"] = prompts
        return {"examples": 0, "prompts": len(prompts), "out": str(out)}

    monkeypatch.setattr(trajectories, "write_trajectories", capture)
    args = SimpleNamespace(
        threads=None,
        target="unused",
        dtype="fp32",
        prompts=spec,
        limit=None,
        gen_length=8,
        steps_per_block=None,
        full=False,
        out=str(tmp_path / "t"),
        shard_size=8,
    )
    trajectories.run_cli(args)
    return seen["prompts"]


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_each_spelling_resolves_the_same_way_from_each_caller(
    spelling, files, tiny_tokenizer, monkeypatch, tmp_path
):
    spec = spelling.format(**{k: str(v) for k, v in files.items()})
    texts = expected_texts(spelling, files)
    assert prompt_texts(spec) == texts
    ids = [encode_chat(tiny_tokenizer, t) for t in texts]
    check_spec(spec)  # the CLI's cheap check passes it
    assert encode_prompts(spec, tiny_tokenizer) == ids
    assert load_prompts(spec, tiny_tokenizer, None) == ids  # bench, evaluations
    assert _bench_prompts(SimpleNamespace(prompts=spec, limit=None), tiny_tokenizer)[1] == ids
    assert trajectories_prompts(spec, tiny_tokenizer, monkeypatch, tmp_path) == ids


def test_a_limit_takes_the_first_prompts_of_the_slice(files, tiny_tokenizer):
    every = prompt_texts("mtbench")
    assert prompt_texts("mtbench[40:]", limit=3) == every[40:43]
    assert prompt_texts("sharegpt", limit=2) == expected_texts("sharegpt[:3]", files)[:2]
    assert (
        load_prompts(f"{files['txt']}[1:]", tiny_tokenizer, 2)
        == encode_prompts(str(files["txt"]), tiny_tokenizer)[1:3]
    )


@pytest.mark.parametrize(
    "spec,says",
    [
        ("nosuch", "prompts nosuch: no such file, and not a prompt set (mtbench, humaneval,"),
        ("nosuch[0:3]", "prompts nosuch: no such file, and not a prompt set"),
        ("mtbench[a:b]", "a slice is NAME[START:STOP] with whole numbers"),
        ("{dir}", "is a folder: pass a .jsonl"),
    ],
)
def test_a_spec_that_names_nothing_is_one_line_from_each_caller(
    spec, says, tmp_path, tiny_tokenizer, capsys
):
    spec = spec.format(dir=tmp_path)
    for call in (
        lambda: check_spec(spec),
        lambda: prompt_texts(spec),
        lambda: load_prompts(spec, tiny_tokenizer, None),
        lambda: _bench_prompts(SimpleNamespace(prompts=spec, limit=None), tiny_tokenizer),
    ):
        with pytest.raises(DraftsmithError) as refused:
            call()
        assert says in str(refused.value) and "\n" not in str(refused.value)
    # the CLI refuses it before loading the target
    code = main(["trajectories", "--target", "unused", "--prompts", spec, "--out", "o"])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert code == 2 and len(lines) == 1 and says in lines[0] and "Traceback" not in err, err


@pytest.mark.parametrize(
    "content,says",
    [
        ("", "no prompts in"),
        ('["a list"]\n', "a JSON list, not an object"),
        ("{not json\n", "not valid JSON"),
        ('{"text": "no prompt key"}\n', "needs a non-empty 'prompt' string or a 'turns' list"),
    ],
)
def test_a_file_without_prompts_is_one_line(content, says, tmp_path, tiny_tokenizer):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(DraftsmithError, match=None) as refused:
        encode_prompts(str(path), tiny_tokenizer)
    assert says in str(refused.value) and "\n" not in str(refused.value)


def test_empty_slices_and_limits_below_one_are_refused():
    with pytest.raises(DraftsmithError, match=r"mtbench\[90:\] selects no prompts: mtbench has 80"):
        prompt_texts("mtbench[90:]")
    with pytest.raises(DraftsmithError, match="must be >= 1, got 0"):
        prompt_texts("mtbench", limit=0)
