"""Top warp-stall lines of an ncu source page: `ncu -i REP --page source --csv --print-source sass > SRC.csv`,
then `python scripts/dev/ncu_stall_lines.py SRC.csv` prints the total stall samples and every SASS line
holding >= 1 % of them with its dominant stall reason."""
import csv
import sys


def main(path):
    rows = list(csv.reader(open(path)))
    hdr = [i for i, r in enumerate(rows) if "Source" in r and any("Sampling" in c for c in r)][0]
    h, data = rows[hdr], rows[hdr + 1:]
    si = h.index("Source")
    ci = [j for j, c in enumerate(h) if "Warp Stall Sampling (All" in c][0]

    def num(x):
        x = x.replace(",", "")
        return float(x) if x.replace(".", "").isdigit() else 0.0

    tot = sum(num(r[ci]) for r in data if len(r) > ci)
    print("total samples", tot)
    reasons = [k for k in range(len(h)) if h[k].startswith("stall_") and "Not" not in h[k]]
    for j, r in enumerate(data):
        if len(r) > ci and num(r[ci]) > 0.01 * tot:
            top = max(reasons, key=lambda k: num(r[k]))
            print(j, r[ci], h[top], r[si][:70])


if __name__ == "__main__":
    main(sys.argv[1])
