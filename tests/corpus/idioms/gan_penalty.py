"""A WGAN-GP critic step with its discriminator in DDP: the gradient penalty takes
``autograd.grad(..., create_graph=True)`` of the critic's output with respect to interpolated
samples, then the critic's loss goes back with ``backward(inputs=list(D.parameters()))`` (only
the critic's gradients); the generator step follows with its own ``backward(inputs=...)``
through the critic's module and averages its gradients by hand.

Source: caogang/wgan-gp, gan_toy.py (calc_gradient_penalty: autograd.grad with
create_graph=True, retain_graph=True, only_inputs=True), with ``Tensor.backward(inputs=...)``
as GAN trainers use it to keep the generator's gradients out of the critic step (e.g. the R1
loop ``d_loss.backward(inputs=list(D.parameters()))``).
Its exercise() runs in all_idioms.py (tests/test_corpus.py)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import autograd, nn
from torch.nn.parallel import DistributedDataParallel

LAMBDA = 10.0


def gradient_penalty(critic: nn.Module, real: torch.Tensor, fake: torch.Tensor) -> torch.Tensor:
    alpha = torch.rand(real.size(0), 1).expand(real.size())
    interpolates = (alpha * real + (1 - alpha) * fake).requires_grad_(True)
    scores = critic(interpolates)
    (gradients,) = autograd.grad(
        outputs=scores,
        inputs=interpolates,
        grad_outputs=torch.ones_like(scores),
        create_graph=True,
        retain_graph=True,
        only_inputs=True,
    )
    return ((gradients.norm(2, dim=1) - 1) ** 2).mean() * LAMBDA


def checksum(module: nn.Module) -> float:
    return round(sum(float(p.detach().sum()) for p in module.parameters()), 4)


def exercise(rank: int, world_size: int) -> None:
    torch.manual_seed(0)  # the same weights on every rank
    generator = nn.Sequential(nn.Linear(2, 8), nn.ReLU(), nn.Linear(8, 2))
    critic = DistributedDataParallel(nn.Sequential(nn.Linear(2, 8), nn.ReLU(), nn.Linear(8, 1)))
    opt_d = torch.optim.SGD(critic.parameters(), lr=0.01)
    opt_g = torch.optim.SGD(generator.parameters(), lr=0.01)
    torch.manual_seed(1 + rank)  # each rank its own data
    for step in range(3):
        real = torch.randn(16, 2) + 2.0
        fake = generator(torch.randn(16, 2))
        opt_d.zero_grad()
        penalty = gradient_penalty(critic, real, fake.detach())
        # fake not detached: inputs= alone keeps the generator's gradients out of this step
        d_loss = critic(fake).mean() - critic(real).mean() + penalty
        d_loss.backward(inputs=list(critic.parameters()))
        untouched = all(p.grad is None for p in generator.parameters())
        opt_d.step()
        opt_g.zero_grad()
        g_loss = -critic.module(generator(torch.randn(16, 2))).mean()
        g_loss.backward(inputs=list(generator.parameters()))
        for parameter in generator.parameters():  # the generator is not in DDP: by hand
            assert parameter.grad is not None
            dist.all_reduce(parameter.grad)
            parameter.grad /= world_size
        opt_g.step()
        print(
            f"step {step}: penalty {penalty.item():.4f} critic {checksum(critic)} "
            f"generator {checksum(generator)} (untouched by the critic step: {untouched})"
        )
