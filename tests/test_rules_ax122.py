"""AX122 (a cross-entropy written by hand where F.cross_entropy is faster) beyond its
inline examples: the shapes of the review's scripts and of public code, and the
look-alikes beside them."""

from __future__ import annotations

from torchaxe.scan.engine import ScanOptions, scan_source

OPTIONS = ScanOptions(target="cuda", select=("AX122",))


def lines(source: str) -> list[int]:
    return sorted(f.line for f in scan_source(source, "m.py", OPTIONS).findings)


def test_label_smoothing_and_contrastive_losses_are_found_through_names_and_modules():
    source = '''\
import torch
import torch.nn as nn
import torch.nn.functional as F


class LabelSmoothingLoss(nn.Module):
    def __init__(self, smoothing, ignore_index):
        super().__init__()
        self.smoothing, self.ignore_index = smoothing, ignore_index

    def forward(self, logits, target):
        log_probs = F.log_softmax(logits, dim=-1)
        nll = -log_probs.gather(dim=-1, index=target.unsqueeze(-1)).squeeze(-1)
        smooth = -log_probs.mean(dim=-1)
        loss = (1.0 - self.smoothing) * nll + self.smoothing * smooth
        mask = target.ne(self.ignore_index)
        return (loss * mask).sum() / mask.sum()


class CrossEntropyLabelSmooth(nn.Module):
    def __init__(self, num_classes, epsilon=0.1):
        super().__init__()
        self.num_classes, self.epsilon = num_classes, epsilon
        self.logsoftmax = nn.LogSoftmax(dim=1)

    def forward(self, inputs, targets):
        log_probs = self.logsoftmax(inputs)
        targets = torch.zeros(log_probs.size()).scatter_(1, targets.unsqueeze(1).data.cpu(), 1)
        targets = (1 - self.epsilon) * targets + self.epsilon / self.num_classes
        return (-targets * log_probs).mean(0).sum()


def nt_xent(pos, neg):
    numerator = torch.exp(pos)
    denominator = numerator + torch.exp(neg).sum(dim=1)
    loss = -torch.log(numerator / denominator)
    return loss.mean()


def train(loader, model):
    total = 0.0
    for x, y in loader:
        probs = F.softmax(model(x), dim=1)
        loss = -(F.one_hot(y, 10) * torch.log(probs)).sum(1).mean()
        loss.backward()
        total += loss.item() * x.size(0)
'''
    assert lines(source) == [13, 30, 36, 44]


def test_policy_gradients_focal_losses_entropies_and_probability_targets_are_left_alone():
    source = '''\
import torch
import torch.nn.functional as F


def reinforce(logits, actions, scaled_rewards):
    log_prob = F.log_softmax(logits, dim=1)
    log_prob_actions = scaled_rewards * log_prob[range(len(log_prob)), actions]
    return -log_prob_actions.mean()


def coma(pi, actions, advantages):
    pi_taken = torch.gather(F.softmax(pi, -1), dim=1, index=actions.reshape(-1, 1)).squeeze(1)
    log_pi_taken = torch.log(pi_taken)
    return -(advantages * log_pi_taken).sum()


def focal(x, target, gamma):
    logpt = F.log_softmax(x, dim=1)
    logpt = logpt.gather(1, target)
    pt = logpt.exp()
    return (-1 * (1 - pt) ** gamma * logpt).mean()


def entropy(logits, mask):
    log_probs = F.log_softmax(logits, dim=-1)
    probabilities = torch.exp(log_probs) * mask.unsqueeze(-1)
    return (-log_probs * probabilities).sum(-1)


def distil(student, teacher, t):
    return -(F.softmax(teacher / t, 1) * F.log_softmax(student / t, 1)).sum(1).mean()


def kl(p_logits, q_logits):
    p = F.softmax(p_logits, -1)
    return (p * (torch.log(p) - torch.log(F.softmax(q_logits, -1)))).sum(-1)
'''
    assert lines(source) == []
