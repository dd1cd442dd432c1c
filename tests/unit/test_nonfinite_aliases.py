"""Which tensors share storage, as the nan/inf check reads the op log (checks/nonfinite/aliases):
a view joins its input's group; a new tensor that reuses a dead view's id leaves that group, so a
write into it is not taken for a write into the parameter the dead view was made from."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from opwatch.checks.nonfinite.aliases import Aliases


def test_a_view_joins_its_inputs_group_and_a_reused_id_leaves_it():
    aliases = Aliases()
    weight, transposed, other = 1, 2, 3
    aliases.view(weight, [transposed])
    assert aliases.sharing(transposed) == {weight, transposed} == aliases.sharing(weight)
    aliases.forget(transposed)  # a new tensor (a cache, an activation) now has that id
    assert aliases.sharing(transposed) == (transposed,)
    assert aliases.sharing(weight) == (weight,)  # a group of one is no group
    aliases.view(weight, [other])
    assert aliases.sharing(other) == {weight, other}


def test_forgetting_a_groups_root_keeps_its_views_together():
    aliases = Aliases()
    base, first, second = 10, 11, 12
    aliases.view(base, [first])
    aliases.view(first, [second])
    aliases.forget(base)  # the base died and its id was reused; its views share storage still
    assert aliases.sharing(first) == {first, second} == aliases.sharing(second)
    assert aliases.sharing(base) == (base,)
    aliases.forget(99)  # an id in no group: nothing to do
    assert aliases.sharing(first) == {first, second}


def test_a_view_takes_an_id_out_of_its_old_group():
    # the sequence that ended a watch on T5's tests with a KeyError: id 1 was in 4's group and a
    # view put it in 3's without taking it out; forgetting 1 then 4 then removed 3's group twice
    aliases = Aliases()
    aliases.view(3, [4, 2])
    aliases.view(1, [4, 3])
    assert aliases.sharing(3) == {1, 3, 4} and aliases.sharing(2) == (2,)
    aliases.forget(1)
    aliases.forget(4)
    aliases.forget(2)
    assert aliases.sharing(3) == (3,)


_IDS = st.integers(min_value=0, max_value=7)
_STEPS = st.lists(
    st.one_of(
        st.tuples(st.just("view"), _IDS, st.lists(_IDS, max_size=3)),
        st.tuples(st.just("forget"), _IDS),
    ),
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(_STEPS)
def test_random_views_and_forgets_keep_the_groups_a_partition(steps):
    # the model: a list of disjoint groups; a view moves its outputs into its source's group,
    # a forget takes an id out of its group; a group of one is no group
    aliases = Aliases()
    groups: list[set] = []

    def group_of(ident):
        return next((group for group in groups if ident in group), None)

    for step in steps:
        if step[0] == "view":
            _, source, outputs = step
            aliases.view(source, outputs)
            target = group_of(source)
            if target is None:
                target = {source}
                groups.append(target)
            for ident in outputs:
                old = group_of(ident)
                if old is not target:
                    if old is not None:
                        old.discard(ident)
                    target.add(ident)
        else:
            aliases.forget(step[1])
            old = group_of(step[1])
            if old is not None:
                old.discard(step[1])
        groups = [group for group in groups if len(group) > 1]
        for ident in range(8):
            expected = group_of(ident)
            sharing = aliases.sharing(ident)
            assert set(sharing) == (expected if expected is not None else {ident})
