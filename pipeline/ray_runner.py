from .errors import BatchgenError


def run_ray(*a, **k):
    raise BatchgenError('--runner ray: not available yet')
