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


def welch(a: list[float], b: list[float]) -> tuple[float, float]:
    """mean(a) - mean(b) and the half-width of its 95 % Welch interval (unpaired, unequal
    variances; Welch-Satterthwaite degrees of freedom, rounded down); nan with fewer than two
    values on a side."""
    d = statistics.mean(a) - statistics.mean(b)
    if len(a) < 2 or len(b) < 2:
        return d, float("nan")
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    se = math.sqrt(va + vb)
    if se == 0:
        return d, 0.0
    df = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1))
    return d, t95(max(1, int(df))) * se


def binomial_ci(k: int, n: int) -> tuple[float, float]:
    """Wilson's 95 % interval for a proportion k / n."""
    if n == 0:
        return float("nan"), float("nan")
    z, p = 1.959964, k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return centre - half, centre + half
