"""Small integer helpers shared by the host-side modules."""


def cdiv(a: int, b: int) -> int:
    """Ceiling of a / b for integers (b > 0): e.g. the blocks that hold `a` tokens of `b` per block."""
    return -(-a // b)
