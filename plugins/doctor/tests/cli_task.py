"""Factories for the doctor's command-line tests (``corelooper run CONFIG`` names them)."""

from __future__ import annotations


def model():
    import torch
    from doctor_toys import Classifier

    return Classifier(torch.nn.ReLU())


def square_model():
    """Overflows float32 on the outlier sample of ``overflow_train``."""
    from doctor_toys import Classifier, Square

    return Classifier(Square())


def train():
    from doctor_toys import samples

    return samples(n=64)


def overflow_train():
    from doctor_toys import samples

    return samples(n=64, outlier=1e30)
