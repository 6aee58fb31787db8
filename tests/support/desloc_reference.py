"""A simulation of DES-LOC over R replicas, written from the rule in
docs/algorithms.md: every replica a copy of the model stepped by torch's own
Adam (the algorithm's inner optimizer is the user's), and the averages in
float64 after every step that completes a period. The reference of
tests/algorithms/replicas/test_desloc.py and of DES-LOC's fault-tolerance
tests."""

import copy

import torch


class DESLOCSim:
    """replicas[r]: rank r's model; optims[r]: its Adam (make_optimizer's).
    step(grads) steps every replica with its own gradients, then takes the
    averages due; drop(r) removes a rank (its replica and Adam state leave
    with it); join() appends a copy of rank 0's (a replacement)."""

    def __init__(self, model, ranks, make_optimizer, param_every, exp_avg_every,
                 exp_avg_sq_every):
        self.replicas = [copy.deepcopy(model) for _ in range(ranks)]
        self.optims = [make_optimizer(m.parameters()) for m in self.replicas]
        self.make_optimizer = make_optimizer
        self.periods = {"params": param_every, "exp_avg": exp_avg_every,
                        "exp_avg_sq": exp_avg_sq_every}
        self.steps = 0
        self.frozen = set()     # parameter indices without gradients (and no average)

    def step(self, grads):
        """grads[r]: rank r's gradients (None: none for that parameter)."""
        for model, opt, g in zip(self.replicas, self.optims, grads):
            for p, gi in zip(model.parameters(), g):
                p.grad = None if gi is None else gi.clone()
            opt.step()
        self.steps += 1
        self.average(range(len(self.replicas)))

    def average(self, ranks):
        """The averages due after step self.steps, over `ranks`."""
        ranks = list(ranks)
        for what, every in self.periods.items():
            if self.steps % every:
                continue
            for i in range(len(list(self.replicas[0].parameters()))):
                if i in self.frozen:
                    continue
                tensors = [self._tensor(r, i, what) for r in ranks]
                if any(t is None for t in tensors):
                    continue
                mean = sum(t.double() for t in tensors) / len(tensors)
                with torch.no_grad():
                    for t in tensors:
                        t.copy_(mean)

    def _tensor(self, r, i, what):
        p = list(self.replicas[r].parameters())[i]
        if what == "params":
            return p
        return self.optims[r].state.get(p, {}).get(what)

    def drop(self, r):
        del self.replicas[r], self.optims[r]

    def join(self):
        model = copy.deepcopy(self.replicas[0])
        opt = self.make_optimizer(model.parameters())
        opt.load_state_dict(copy.deepcopy(self.optims[0].state_dict()))
        self.replicas.append(model)
        self.optims.append(opt)
