import pytest

from schemas.capture import CapturePoint, CapturePointError, parse_points


@pytest.mark.parametrize(
    "text", ["embedding", "layer_output:0", "layer_output:31", "final:pre_norm", "final:post_norm"]
)
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
    assert "layer_output:40" in str(e.value) and "32 decoder layers" in str(e.value) and "j < 32" in str(e.value)
    assert CapturePoint.layer_output(31).validate_for(32).layer == 31


def test_boundaries():
    from pipeline.conventions import boundaries as b

    n = 32
    assert b.boundary(CapturePoint.embedding(), n) == 0
    assert b.boundary(CapturePoint.layer_output(2), n) == 3  # o_2 = r_3
    assert b.boundary(CapturePoint.final("pre"), n) == 32  # r_N
    assert b.boundary(CapturePoint.final("post"), n) is None
    assert b.position(CapturePoint.final("post"), n) == 33  # after r_N
    assert b.same_tensor(CapturePoint.layer_output(31), CapturePoint.final("pre"), n)
    assert not b.same_tensor(CapturePoint.layer_output(30), CapturePoint.final("pre"), n)
    assert not b.same_tensor(CapturePoint.final("post"), CapturePoint.final("pre"), n)
    walk = [
        CapturePoint.final("post"),
        CapturePoint.final("pre"),
        CapturePoint.layer_output(31),
        CapturePoint.layer_output(0),
        CapturePoint.embedding(),
    ]
    assert sorted(walk, key=lambda p: b.sort_key(p, n)) == walk[::-1]
    assert b.eagle3_default(n) == [2, 16, 29] and b.eagle3_default(6) == [2, 3, 3]
    with pytest.raises(CapturePointError, match="32 decoder layers"):
        b.boundary(CapturePoint.layer_output(32), n)


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
