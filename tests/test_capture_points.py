import pytest

from schemas.capture import CapturePoint, CapturePointError, parse_points


@pytest.mark.parametrize("text", ["embedding", "layer_output:0", "layer_output:31", "final:pre_norm", "final:post_norm"])
def test_canonical_string_round_trip(text):
    p = CapturePoint.parse(text)
    assert str(p) == text
    assert CapturePoint.parse(str(p)) == p
    assert CapturePoint.model_validate_json(p.model_dump_json()) == p


@pytest.mark.parametrize("bad", ["layer3", "layer_output:-1", "final", "final:mid_norm", "o_2", ""])
def test_parse_rejects_with_accepted_forms(bad):
    with pytest.raises(CapturePointError, match="expected 'embedding', 'layer_output:<j>'"):
        CapturePoint.parse(bad)


def test_layer_beyond_target_names_layer_count():
    with pytest.raises(CapturePointError) as e:
        CapturePoint.layer_output(40).validate_for(32)
    assert "layer_output:40" in str(e.value) and "32 decoder layers" in str(e.value) and "0..31" in str(e.value)
    assert CapturePoint.layer_output(31).validate_for(32).layer == 31


def test_boundaries():
    n = 32
    assert CapturePoint.embedding().boundary(n) == 0
    assert CapturePoint.layer_output(2).boundary(n) == 3          # o_2 = r_3
    assert CapturePoint.final("pre").boundary(n) == 32            # r_N
    assert CapturePoint.final("post").boundary(n) is None
    assert CapturePoint.layer_output(31).same_tensor(CapturePoint.final("pre"), n)
    assert not CapturePoint.layer_output(30).same_tensor(CapturePoint.final("pre"), n)
    assert not CapturePoint.final("post").same_tensor(CapturePoint.final("pre"), n)


def test_invalid_field_combinations():
    with pytest.raises(ValueError):
        CapturePoint(kind="layer_output")
    with pytest.raises(ValueError):
        CapturePoint(kind="final")
    with pytest.raises(ValueError):
        CapturePoint(kind="embedding", layer=1)


def test_parse_points_accepts_mixed_forms():
    pts = parse_points(["embedding", {"kind": "layer_output", "layer": 2}, CapturePoint.final("post")])
    assert [str(p) for p in pts] == ["embedding", "layer_output:2", "final:post_norm"]
