import torch

x = torch.ones(5, 3)
w = torch.ones(3, 2)
h = x * 2
y = x.double() @ w
