"""Story 1: a tensor made on the wrong device, and then a mask of the wrong dtype.

The mask and the source live on a second device (``meta`` here, ``cuda`` in real life), but
``torch.zeros(6)`` forgot its ``device=``. Fix the device and the mask's dtype bites next.
"""

import torch


def myfunc(mask, x):
    y = torch.zeros(6)
    y.masked_scatter_(mask, x)
    return y


def myfunc_fixed_device(mask, x):
    y = torch.zeros(6, device=mask.device)
    y.masked_scatter_(mask, x)
    return y


mask = torch.tensor([0, 1, 0, 1, 1, 0], device="meta")
source = torch.tensor([1.0, 2.0, 3.0], device="meta")
for attempt in (myfunc, myfunc_fixed_device):
    try:
        attempt(mask, source)
    except Exception as error:  # the story goes on to its second bug
        print(f"{attempt.__name__} raised {type(error).__name__}: {str(error).splitlines()[0]}")
