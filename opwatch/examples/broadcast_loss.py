"""Story 2: a loss that broadcasts ``(4,)`` against ``(4, 1)`` into ``(4, 4)``.

The model never fits ``y = x1 + 2 * x2 + 3``: ``pred`` is a column, ``y`` a vector.
"""

import torch


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)

    def forward(self, x):
        return self.layer(x)


torch.manual_seed(0)
x = torch.tensor([[0.0, 0.0], [0.0, 1.0], [1.0, 0.0], [1.0, 1.0]])
y = torch.tensor([3.0, 5.0, 4.0, 6.0])
model = Model()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(100):
    optimizer.zero_grad()
    pred = model(x)
    squared_diff = (y - pred) ** 2
    loss = squared_diff.mean()
    loss.backward()
    optimizer.step()
print(f"final loss {loss.item():.3f} (it should be near 0)")
