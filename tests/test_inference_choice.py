"""The export's inference block decides verifier and stop policy unless a flag overrides it; sources
are recorded."""

import pytest

from draftsmith.runtime.acceptance.choice import (
    choose_stop_policy,
    choose_verifier,
    option_sources,
    parse_stop_policy,
)
from draftsmith.runtime.acceptance.rejection_sampling import RejectionSamplingVerifier
from draftsmith.runtime.acceptance.stop_policies import ConfidenceStop, FixedDepth
from draftsmith.runtime.acceptance.verifiers import GreedyVerifier, TypicalVerifier

pytestmark = pytest.mark.unit

TYPICAL_EXPORT = {
    "inference": {
        "verifier": "typical",
        "typical": {"posterior_threshold": 0.2, "posterior_alpha": 0.5},
        "stop_policy": {"kind": "confidence", "threshold": 0.4, "max_depth": 5},
        "tree": [[0], [0, 0]],
        "top_k": 10,
    }
}


def test_an_export_trained_for_typical_acceptance_is_served_typical():
    verifier, info = choose_verifier("auto", 0.7, "torch", TYPICAL_EXPORT)
    assert isinstance(verifier, TypicalVerifier) and verifier.posterior_threshold == 0.2
    assert info == {"name": "typical", "source": "export"}
    verifier, info = choose_verifier("greedy", 0.0, "torch", TYPICAL_EXPORT)  # the flag wins
    assert isinstance(verifier, GreedyVerifier) and info == {"name": "greedy", "source": "flag"}


def test_verifier_defaults_follow_the_temperature():
    greedy_export = {"inference": {"verifier": "greedy"}}
    assert isinstance(choose_verifier("auto", 0.0, "torch", greedy_export)[0], GreedyVerifier)
    verifier, info = choose_verifier(
        "auto", 0.8, "torch", greedy_export
    )  # lossless at T>0 = rejection sampling
    assert isinstance(verifier, RejectionSamplingVerifier) and info == {
        "name": "rejection",
        "source": "export",
    }
    assert choose_verifier("auto", 0.0, "torch", None)[1] == {"name": "greedy", "source": "default"}
    with pytest.raises(ValueError, match="unknown verifier 'magic'"):
        choose_verifier("magic", 0.0, "torch", None)


def test_stop_policies_parse_from_flags_and_exports():
    assert parse_stop_policy("fixed:3") == FixedDepth(3) and parse_stop_policy("none") is None
    assert parse_stop_policy("confidence:0.6") == ConfidenceStop(0.6)
    assert parse_stop_policy("confidence:0.5:6") == ConfidenceStop(0.5, 6)
    assert parse_stop_policy({"kind": "fixed"}) is None and parse_stop_policy(
        {"kind": "fixed", "max_depth": 2}
    ) == FixedDepth(2)
    policy, info = choose_stop_policy(None, TYPICAL_EXPORT)
    assert policy == ConfidenceStop(0.4, 5) and info == {
        "spec": "confidence:0.4:5",
        "source": "export",
    }
    policy, info = choose_stop_policy("fixed:2", TYPICAL_EXPORT)
    assert policy == FixedDepth(2) and info == {"spec": "fixed:2", "source": "flag"}
    for bad in ("fixed:two", "confidence", "sometimes:3"):
        with pytest.raises(ValueError, match="use fixed:K, confidence:THRESHOLD"):
            parse_stop_policy(bad)
    with pytest.raises(ValueError, match="needs an acceptance head"):
        parse_stop_policy("learned:0.3")


def test_option_sources_mark_flags_over_export_values():
    sources = option_sources(TYPICAL_EXPORT, {"tree": [[0]]})
    assert sources["tree"] == {"value": [[0]], "source": "flag"} and sources["top_k"] == {
        "value": 10,
        "source": "export",
    }
    assert "verifier" not in sources and "stop_policy" not in sources
