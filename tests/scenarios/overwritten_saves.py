"""Training loops whose backward raises torch's "one of the variables needed for gradient
computation has been modified by an inplace operation": a residual added in place into an
activation the next Linear saved, a feature zeroed by index assignment after the tanh that saved
it, a GAN whose generator loss reuses the discriminator's output from before the
discriminator's step. Each has a healthy twin (``fixed=True``) that trains. Tests look lines up
by their comments."""

import torch
from torch import nn


class ResidualMLP(nn.Module):
    def __init__(self, fixed=False):
        super().__init__()
        self.fc1, self.fc2, self.out = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 1)
        self.fixed = fixed

    def forward(self, x):
        h = torch.nn.functional.gelu(self.fc1(x))
        y = self.fc2(h)  # the Linear that saves h
        if self.fixed:
            h = h + y
        else:
            h += y  # the residual written in place
        return self.out(h)


def train_residual(fixed=False, steps=3):
    torch.manual_seed(0)
    model = ResidualMLP(fixed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(steps):
        x, target = torch.randn(8, 16), torch.randn(8, 1)
        loss = nn.functional.mse_loss(model(x), target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return loss


class DroppedFeature(nn.Module):
    def __init__(self, fixed=False):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(10, 20), nn.Tanh())  # the tanh that saves its result
        self.head = nn.Linear(20, 1)
        self.fixed = fixed

    def forward(self, x):
        h = self.body(x)
        if self.fixed:
            h = h.clone()
        h[:, 0] = 0.0  # the first feature dropped
        return self.head(h)


def train_dropped_feature(fixed=False, steps=3):
    torch.manual_seed(0)
    model = DroppedFeature(fixed)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(steps):
        loss = model(torch.randn(4, 10)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return loss


def train_gan(fixed=False, steps=3):
    torch.manual_seed(0)
    generator = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2))
    discriminator = nn.Sequential(nn.Linear(2, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1))
    opt_g = torch.optim.Adam(generator.parameters(), lr=2e-4, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(discriminator.parameters(), lr=2e-4, betas=(0.5, 0.999))
    bce = nn.BCEWithLogitsLoss()
    for _ in range(steps):
        real, fake = torch.randn(16, 2) + 2, generator(torch.randn(16, 8))
        d_fake = discriminator(fake)  # the discriminator's output on the fake batch
        d_loss = bce(discriminator(real), torch.ones(16, 1)) + bce(d_fake, torch.zeros(16, 1))
        opt_d.zero_grad()
        d_loss.backward(retain_graph=True)
        opt_d.step()  # the discriminator's step
        if fixed:
            d_fake = discriminator(fake)
        g_loss = bce(d_fake, torch.ones(16, 1))
        opt_g.zero_grad()
        g_loss.backward()
        opt_g.step()
    return g_loss
