"""The toy method's own test: the head predicts over the whole vocabulary, with the bias its config
asks for."""

import pytest

from draftsmith.heads.toy import ToyHead

pytestmark = pytest.mark.unit


def test_the_head_scores_every_token_with_the_bias_asked_for():
    assert (
        ToyHead(4, 7, bias=False).proj.out_features == 7
        and ToyHead(4, 7, bias=True).proj.bias is not None
    )
