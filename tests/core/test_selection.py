"""surgery.select: names, globs, ``re:`` regexes, types, predicates, exclusions and errors."""

from __future__ import annotations

import pytest
from torch import nn

import surgery
from surgery.core.errors import ConfigError, ConfigTypeError


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(4, 4, 3)
        self.bn1 = nn.BatchNorm2d(4)
        self.conv2 = nn.Conv2d(4, 4, 3)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3)
        self.layer1 = nn.Sequential(Block(), Block())
        self.layer2 = nn.Sequential(Block())
        self.fc = nn.Linear(4, 4)
        self.fc2 = nn.Linear(4, 2)


@pytest.fixture
def net() -> Net:
    return Net()


def test_none_selects_every_module_in_model_order(net):
    assert list(surgery.select(net)) == [name for name, _ in net.named_modules()]


def test_exact_name_selects_that_module_only(net):
    chosen = surgery.select(net, "layer1.0.conv1")
    assert list(chosen) == ["layer1.0.conv1"]
    assert chosen["layer1.0.conv1"] is net.layer1[0].conv1


def test_exact_name_of_container_does_not_select_its_children(net):
    assert list(surgery.select(net, "layer2")) == ["layer2"]


def test_glob_star_is_one_name_segment_and_keeps_model_order(net):
    assert list(surgery.select(net, "layer1.*.conv2")) == ["layer1.0.conv2", "layer1.1.conv2"]
    assert list(surgery.select(net, "layer1.*")) == ["layer1.0", "layer1.1"]  # not layer1.0.conv1
    with pytest.raises(surgery.SelectionError, match="'\\*.conv1': matches no module"):
        surgery.select(net, "*.conv1")  # conv1 sits two levels down


def test_glob_double_star_is_any_number_of_segments(net):
    assert list(surgery.select(net, "**.conv1")) == ["layer1.0.conv1", "layer1.1.conv1", "layer2.0.conv1"]
    below = list(surgery.select(net, "layer1.**"))
    assert below[:2] == ["layer1.0", "layer1.0.conv1"] and all(n.startswith("layer1.") for n in below)
    assert "layer1" not in below  # below it, not the container itself
    assert list(surgery.select(net, "layer1.**.conv2")) == ["layer1.0.conv2", "layer1.1.conv2"]


@pytest.mark.parametrize(
    ("pattern", "name", "matches"),
    [
        ("model.layers.*", "model.layers.0", True),
        ("model.layers.*", "model.layers.0.self_attn.q_proj", False),  # the surprise the old globs gave
        ("model.layers.**", "model.layers.0.self_attn.q_proj", True),
        ("model.layers.*.self_attn.?_proj", "model.layers.11.self_attn.q_proj", True),
        ("a.**.b", "a.b", True),
        ("a.**.b", "a.x.y.b", True),
        ("**", "anything.at.all", True),
        ("layer[!2].0", "layer1.0", True),
        ("layer[!2].0", "layer2.0", False),
        ("fc[", "fc[", True),
        ("**.**", "a.b", True),
        ("a.**.**.b", "a.x.b", True),
    ],
)
def test_glob_semantics_on_dotted_names(pattern, name, matches):
    from surgery.core.selection import glob_regex

    assert (glob_regex(pattern).fullmatch(name) is not None) is matches


def test_glob_character_class(net):
    assert list(surgery.select(net, "layer[12].0.bn1")) == ["layer1.0.bn1", "layer2.0.bn1"]


def test_plain_string_is_not_a_regex(net):
    # As a regex "fc." would match "fc2"; as a name/glob it matches nothing.
    with pytest.raises(surgery.SelectionError):
        surgery.select(net, "fc.")


def test_regex_needs_prefix_and_matches_the_whole_name(net):
    assert list(surgery.select(net, "re:fc")) == ["fc"]  # a search would also hit "fc2"
    assert list(surgery.select(net, r"re:fc\d*")) == ["fc", "fc2"]
    assert list(surgery.select(net, r"re:layer\d\.0\.conv\d")) == [
        "layer1.0.conv1",
        "layer1.0.conv2",
        "layer2.0.conv1",
        "layer2.0.conv2",
    ]


def test_regex_that_only_matches_a_substring_is_an_error(net):
    with pytest.raises(surgery.SelectionError) as info:
        surgery.select(net, "re:conv1")
    assert "re:conv1" in str(info.value)


def test_invalid_regex_is_a_selection_error(net):
    with pytest.raises(surgery.SelectionError) as info:
        surgery.select(net, "re:layer(1")
    assert "re:layer(1" in str(info.value)
    assert "regular expression" in str(info.value)


def test_type_matches_with_isinstance(net):
    assert list(surgery.select(net, nn.Linear)) == ["fc", "fc2"]
    assert list(surgery.select(net, nn.Module)) == [name for name, _ in net.named_modules()]


def test_tuple_of_types(net):
    chosen = surgery.select(net, (nn.Linear, nn.BatchNorm2d))
    assert list(chosen) == ["layer1.0.bn1", "layer1.1.bn1", "layer2.0.bn1", "fc", "fc2"]


def test_type_matching_includes_subclasses():
    class MyLinear(nn.Linear):
        pass

    model = nn.Sequential(MyLinear(2, 2), nn.ReLU())
    assert list(surgery.select(model, nn.Linear)) == ["0"]


@pytest.mark.parametrize("spec", ["type:Conv2d", "type:torch.nn.Conv2d", "type:torch.nn.modules.conv.Conv2d"])
def test_type_string(net, spec):
    assert list(surgery.select(net, spec)) == list(surgery.select(net, nn.Conv2d))
    assert len(surgery.select(net, spec)) == 7


@pytest.mark.parametrize("spec", ["type:Conv9d", "type:no.such.module.Thing", "type:torch.nn.functional.relu"])
def test_type_string_naming_no_class_is_an_error(net, spec):
    with pytest.raises(surgery.SelectionError) as info:
        surgery.select(net, spec)
    assert spec in str(info.value)


def test_predicate_receives_module_and_qualified_name(net):
    seen = []

    def wide_convs(module, name):
        seen.append(name)
        return isinstance(module, nn.Conv2d) and name.startswith("layer1")

    assert list(surgery.select(net, wide_convs)) == [
        "layer1.0.conv1",
        "layer1.0.conv2",
        "layer1.1.conv1",
        "layer1.1.conv2",
    ]
    assert "layer2.0.conv2" in seen and "" in seen


def test_list_is_a_union_in_model_order(net):
    assert list(surgery.select(net, ["fc2", "stem", nn.BatchNorm2d])) == [
        "stem",
        "layer1.0.bn1",
        "layer1.1.bn1",
        "layer2.0.bn1",
        "fc2",
    ]


def test_tuple_of_strings_is_a_list_of_patterns(net):
    assert list(surgery.select(net, ("fc2", "stem"))) == ["stem", "fc2"]


def test_exclude_beats_include(net):
    chosen = surgery.select(net, nn.Conv2d, exclude=["layer1.**", "stem"])
    assert list(chosen) == ["layer2.0.conv1", "layer2.0.conv2"]


def test_excluding_everything_selected_is_an_error(net):
    with pytest.raises(surgery.SelectionError) as info:
        surgery.select(net, "fc", exclude=nn.Linear)
    assert "empty" in str(info.value)


def test_exclude_alone_starts_from_every_module(net):
    chosen = surgery.select(net, exclude="re:layer.*")
    assert list(chosen) == ["", "stem", "fc", "fc2"]


def test_pattern_matching_nothing_names_pattern_and_close_names(net):
    with pytest.raises(surgery.SelectionError) as info:
        surgery.select(net, "layr1.0.conv1")
    message = str(info.value)
    assert "layr1.0.conv1" in message
    assert "layer1.0.conv1" in message  # difflib suggestion
    assert info.value.field == "select"
    assert isinstance(info.value, ConfigError) and isinstance(info.value, ValueError)


def test_type_matching_nothing_lists_the_types_present(net):
    with pytest.raises(surgery.SelectionError) as info:
        surgery.select(net, nn.LSTM)
    message = str(info.value)
    assert "LSTM" in message
    assert "Conv2d" in message and "Linear" in message


def test_predicate_matching_nothing_is_named(net):
    def never(module, name):
        return False

    with pytest.raises(surgery.SelectionError) as info:
        surgery.select(net, never)
    assert "never" in str(info.value)


def test_every_pattern_of_a_list_must_match(net):
    with pytest.raises(surgery.SelectionError) as info:
        surgery.select(net, ["fc", "layer3.*", "stem"])
    assert "layer3.*" in str(info.value)


def test_exclude_pattern_matching_nothing_is_an_error_naming_the_exclude_field(net):
    with pytest.raises(surgery.SelectionError) as info:
        surgery.select(net, nn.Linear, exclude="fcc", exclude_field="prune.exclude")
    assert info.value.field == "prune.exclude"
    assert "fcc" in str(info.value)
    assert "fc" in str(info.value)


def test_custom_field_name_appears_in_the_message(net):
    with pytest.raises(surgery.SelectionError) as info:
        surgery.select(net, "nope", field="prune.select")
    assert str(info.value).startswith("prune.select=")


@pytest.mark.parametrize("bad", [3, 2.5, [None], [3]])
def test_pattern_of_wrong_type_is_a_type_error(net, bad):
    with pytest.raises(ConfigTypeError) as info:
        surgery.select(net, bad)
    assert isinstance(info.value, TypeError)
    assert info.value.field == "select"


def test_shared_module_is_selected_once_under_its_first_name():
    shared = nn.Linear(2, 2)
    model = nn.Sequential(shared, nn.ReLU(), shared)
    assert list(surgery.select(model, nn.Linear)) == ["0"]


def test_select_does_not_modify_the_model(net):
    before = {k: v.clone() for k, v in net.state_dict().items()}
    surgery.select(net, ["re:.*conv.*", nn.Linear], exclude="fc2")
    after = net.state_dict()
    assert list(after) == list(before)
    assert all(after[k].equal(v) for k, v in before.items())


def test_an_invalid_glob_is_a_selection_error_not_a_traceback(net):
    with pytest.raises(surgery.SelectionError, match=r"select='conv\[z-a\]': not a valid glob: bad character range"):
        surgery.select(net, "conv[z-a]")


@pytest.mark.parametrize("pattern", ["re:(.*.*)*z", "re:(a+)+", "re:(?:.|..)*Z", "re:(ab|a)*c"])
def test_regexes_that_can_backtrack_exponentially_are_refused_at_once(net, pattern):
    """Before: re:(.*.*)*z ran for minutes on a model's names; (?:.|..)*Z took a minute on one."""
    with pytest.raises(surgery.SelectionError, match="exponential time"):
        surgery.select(net, pattern)


def test_linear_time_regexes_are_still_accepted(net):
    assert list(surgery.select(net, "re:layer\\d\\.\\d\\.conv[12]"))[:2] == ["layer1.0.conv1", "layer1.0.conv2"]
    assert "stem" in surgery.select(net, "re:(s|x)tem")
