"""Which tensors share storage, as the nan/inf check reads the op log (checks/nonfinite/aliases):
a view joins its input's group; a new tensor that reuses a dead view's id leaves that group, so a
write into it is not taken for a write into the parameter the dead view was made from."""

from __future__ import annotations

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
