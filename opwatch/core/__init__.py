"""The ground floor: facts about torch and the op log, no watch state.

``compat`` (every private torch API), ``notation`` (``f32[4, 1] cpu``), ``ops`` (the registry
of op facts), ``bounded``, ``fact_tuples``, ``finite`` (the fused "are these finite" check),
``collective_ops`` (torch.distributed facts), ``records`` (the op log's entries) and ``sites``
(the user's frame and the one location format).
"""
