"""Story 3: ``log(0)`` turns into inf, and the inf into nan in the backward pass."""

import torch


class MockModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.unused = torch.nn.Linear(6, 4)

    def forward(self, x):
        return torch.tensor([0.0, 0.25, 0.9, 0.75]) + self.unused(x) * 0.0


torch.manual_seed(0)
model = MockModel()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for epoch in range(3):
    batch_input = torch.randn(6, 6)
    likelihood = model(batch_input)
    log_likelihood = likelihood.log()
    target = -log_likelihood.mean()
    print(f"epoch {epoch}: target {target.item()}")
    optimizer.zero_grad()
    target.backward()
    optimizer.step()
