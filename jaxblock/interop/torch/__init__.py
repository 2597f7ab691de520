"""Weights to and from torch.nn.TransformerEncoderLayer / nn.TransformerEncoder, and a parity harness.

`mapping`: configs and weights both ways (`from_torch`, `to_torch`, `params_to_state_dict`,
`state_dict_to_params`) and `torch_call_kwargs` for our masks. `parity`: `compare`, which runs both
and reports each recorded intermediate, the output and every gradient against `TOLERANCES`.

Importing this package imports torch; importing `jaxblock` does not.
"""

from jaxblock.interop.torch.mapping import (
    as_stack,
    from_torch,
    params_to_state_dict,
    state_dict_to_params,
    to_torch,
    torch_call_kwargs,
)
from jaxblock.interop.torch.parity import TOLERANCES, Check, ParityReport, compare

__all__ = [
    "TOLERANCES",
    "Check",
    "ParityReport",
    "as_stack",
    "compare",
    "from_torch",
    "params_to_state_dict",
    "state_dict_to_params",
    "to_torch",
    "torch_call_kwargs",
]
