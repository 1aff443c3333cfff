"""Derivations (ir/derived.py): a tensor a pass made from a model tensor, as a recipe
that replays on the tensor's current values and survives a round trip through text."""

import json

import pytest
import torch

from kiln.errors import ArtifactError
from kiln.ir.derived import Derivation


def test_view_as_real_replays_on_the_current_values():
    d = Derivation("freqs_cis", ("view_as_real",))
    cis = torch.polar(torch.ones(4, 3), torch.randn(4, 3))
    got = d.apply(cis)
    assert got.shape == (4, 3, 2) and got.dtype == torch.float32 and got.is_contiguous()
    assert torch.equal(got, torch.view_as_real(cis))
    assert torch.equal(d.apply(cis.t()), torch.view_as_real(cis.t()).contiguous())


def test_round_trip_through_text():
    d = Derivation("layers.0.cis", ("view_as_real",))
    assert Derivation.decode(json.loads(json.dumps(d.encode()))) == d


@pytest.mark.parametrize("entry", [
    {"source": "t", "steps": ["rm -rf"]},
    {"source": "t", "steps": []},
    {"source": "t", "steps": [["view_as_real"]]},
    {"source": 3, "steps": ["view_as_real"]},
    ["t", "view_as_real"],
])
def test_a_malformed_or_unknown_recipe_is_an_artifact_error(entry):
    with pytest.raises(ArtifactError):
        Derivation.decode(entry)
