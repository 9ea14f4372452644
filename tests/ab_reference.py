"""AB-training written out the paper's way, for the equivalence tests.

Explicit factor tensors A (m x k) and B (k x n) per compressed weight; the
forward pass uses A @ B; a rank trains its own factor with the other frozen,
averages the factor's gradient inside its group, and the world averages at
each sync.  SGD with momentum and weight decay is written out by hand
(torch's semantics: ``buf = mu * buf + (g + wd * p)``, first ``buf = g + wd * p``),
so nothing here shares code with commhooks.

Optimizer-state rule (the one commhooks documents): a factor starts each AB
phase with fresh state; dense tensors keep theirs until the sync; every sync
starts all state afresh.
"""

import torch
import torch.distributed as dist
from torch.func import functional_call


class ManualSGD:
    def __init__(self, lr, momentum, weight_decay):
        self.lr, self.mu, self.wd = lr, momentum, weight_decay
        self.buf = {}

    def update(self, key, p, g):
        d = g + self.wd * p
        self.buf[key] = d.clone() if key not in self.buf else self.mu * self.buf[key] + d
        return p - self.lr * self.buf[key]

    def forget(self, keys=None):
        if keys is None:
            self.buf.clear()
        for k in keys or []:
            self.buf.pop(k, None)


def to_tall(w):
    mat = w.reshape(w.shape[0], -1)
    return (mat.t(), True) if mat.shape[0] < mat.shape[1] else (mat, False)


def from_tall(mat, transposed, shape):
    return (mat.t() if transposed else mat).reshape(shape)


def mean(t, group, size):
    t = t.clone()
    if size > 1:
        dist.all_reduce(t, group=group)
    return t / size


class FactorReference:
    """One rank of the paper's AB-training, with explicit factors."""

    def __init__(self, model, compressed, role, group, group_size, world, cfg, sgd):
        self.model, self.compressed, self.role = model, compressed, role
        self.group, self.group_size, self.world = group, group_size, world
        self.cfg, self.opt = cfg, ManualSGD(**sgd)
        self.w = {n: p.detach().clone() for n, p in model.named_parameters()}
        self.shapes = {n: p.shape for n, p in model.named_parameters()}
        self.factors = {}  # name -> [A, B, transposed]
        self.phase, self.t, self.entries = "warmup", 0, 0

    # --- transitions (read off the paper's schedule) -----------------------
    def before_step(self):
        c, t = self.cfg, self.t
        if self.phase == "warmup" and t == c["warmup_steps"]:
            self.enter()
        elif self.phase == "ab" and t % c["sync_period"] == 0:
            self.sync()
            if c["full_rank_steps"] == 0:
                self.enter()
        elif self.phase == "full" and t % c["sync_period"] == c["full_rank_steps"]:
            self.enter()

    def enter(self):
        for n in self.compressed:
            mat, tr = to_tall(self.w[n])
            u, s, vh = torch.linalg.svd(mat, full_matrices=False)
            k = int((s > self.cfg["rank_cutoff"] * s[0]).sum())
            if self.entries == 0 and self.cfg.get("first_rank") == "full":
                k = s.numel()  # the authors' code: the first phase trains untruncated factors
            a = u[:, :k] * s[:k].sqrt()
            b = s[:k].sqrt()[:, None] * vh[:k]
            self.factors[n] = [a, b, tr]
            self.opt.forget([n, "A:" + n, "B:" + n])  # the factor starts with fresh state
        self.phase = "ab"
        self.entries += 1

    def dense_w(self, n):
        a, b, tr = self.factors[n]
        return from_tall(a @ b, tr, self.shapes[n])

    def sync(self):
        if self.cfg["sync"] == "full":
            for n in self.compressed:
                self.w[n] = self.dense_w(n)
            for n in self.w:
                self.w[n] = mean(self.w[n], None, self.world)
        else:  # with-stale: world mean of the factors
            for n in self.compressed:
                a, b, tr = self.factors[n]
                a, b = mean(a, None, self.world), mean(b, None, self.world)
                self.w[n] = from_tall(a @ b, tr, self.shapes[n])
            for n in self.w:
                if n not in self.compressed:
                    self.w[n] = mean(self.w[n], None, self.world)
        self.factors = {}
        self.opt.forget()
        self.phase = "full"

    # --- one optimizer step ------------------------------------------------
    def step(self, x, y):
        self.before_step()
        loss_fn = torch.nn.functional.cross_entropy
        if self.phase != "ab":
            leaves = {n: w.clone().requires_grad_() for n, w in self.w.items()}
            loss = loss_fn(functional_call(self.model, leaves, (x,)), y)
            grads = torch.autograd.grad(loss, list(leaves.values()))
            for (n, w), g in zip(self.w.items(), grads):
                self.w[n] = self.opt.update(n, w, mean(g, None, self.world))
        else:
            mine = 0 if self.role == "A" else 1
            leaves = {n: w.clone().requires_grad_() for n, w in self.w.items() if n not in self.compressed}
            train = {n: self.factors[n][mine].clone().requires_grad_() for n in self.compressed}
            params = dict(leaves)
            for n in self.compressed:
                a, b, tr = self.factors[n]
                a, b = (train[n], b) if mine == 0 else (a, train[n])
                params[n] = from_tall(a @ b, tr, self.shapes[n])
            loss = loss_fn(functional_call(self.model, params, (x,)), y)
            grads = torch.autograd.grad(loss, list(leaves.values()) + list(train.values()))
            for (n, w), g in zip(leaves.items(), grads[: len(leaves)]):
                self.w[n] = self.opt.update(n, w.detach(), mean(g, self.group, self.group_size))
            for (n, f), g in zip(train.items(), grads[len(leaves):]):
                key = ("A:" if mine == 0 else "B:") + n
                self.factors[n][mine] = self.opt.update(key, f.detach(), mean(g, self.group, self.group_size))
        self.t += 1

    def weights(self):
        return {n: (self.dense_w(n) if n in self.factors else w) for n, w in self.w.items()}
