"""95 % intervals for the studies' tables: Student's t over seeds, and paired differences."""
import math
import statistics

# two-sided 95 % quantiles of Student's t, by degrees of freedom
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
       15: 2.131, 20: 2.086, 30: 2.042}


def t95(df: int) -> float:
    return T95.get(df) or T95[max(k for k in T95 if k <= df)]


def mean_ci(values: list[float]) -> tuple[float, float]:
    """(mean, half-width of its 95 % t interval); the half-width is nan for one value."""
    m = statistics.mean(values)
    if len(values) < 2:
        return m, float("nan")
    return m, t95(len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))


def paired(a: dict, b: dict) -> tuple[float, float, int]:
    """Mean of a[s] - b[s] over the seeds both have, its 95 % half-width, and their number."""
    seeds = sorted(set(a) & set(b))
    if not seeds:
        return float("nan"), float("nan"), 0
    m, h = mean_ci([a[s] - b[s] for s in seeds])
    return m, h, len(seeds)


def binomial_ci(k: int, n: int) -> tuple[float, float]:
    """Wilson's 95 % interval for a proportion k / n."""
    if n == 0:
        return float("nan"), float("nan")
    z, p = 1.959964, k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return centre - half, centre + half
