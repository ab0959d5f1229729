"""Write ``tasks.jsonl``: 48 room-booking tasks with exactly one valid room each.

Deterministic (fixed seed): running it again rewrites the same bytes, so the file in the repository
is the output of this script and can be checked with ``python make_tasks.py --check``.

Every task lists 3 or 4 candidate rooms. Exactly one room satisfies all four constraints:

* capacity >= attendees,
* every item of ``needs`` is in the room's ``equipment``,
* the room is accessible when ``accessible_required`` is true,
* none of the room's ``booked`` intervals (same date, ``HH:MM-HH:MM``) overlaps the requested
  meeting ``[time, time + duration_min)``.

Each other room breaks exactly one constraint (a "near miss"), so no single check finds the
answer on its own. The position of the right room in the list is balanced within each half of
the file (the train / validation split), so always answering the first (or the last) listed room
scores 7/24, about 0.29, on either half.

Usage::

    python examples/room_booking/make_tasks.py          # (re)write tasks.jsonl next to this file
    python examples/room_booking/make_tasks.py --check  # exit 1 if the file differs or a task is invalid
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

SEED = 20240611
N_TASKS = 48
ROOM_NAMES = ["Nova", "Orion", "Lyra", "Vega", "Atlas", "Cygnus", "Draco", "Pavo"]
EQUIPMENT = ["projector", "whiteboard", "video call", "phone"]
FAILURES = ["capacity", "equipment", "accessible", "booked"]
DATES = ["2025-03-03", "2025-03-04", "2025-03-05", "2025-03-06", "2025-03-07"]
OUT = Path(__file__).with_name("tasks.jsonl")


def _hm(minutes: int) -> str:
    return f"{minutes // 60:02d}:{minutes % 60:02d}"


def _minutes(hm: str) -> int:
    h, m = hm.split(":")
    return int(h) * 60 + int(m)


def overlaps(start: int, end: int, interval: str) -> bool:
    """Whether ``[start, end)`` (minutes after midnight) overlaps an ``HH:MM-HH:MM`` interval."""
    a, b = (_minutes(x) for x in interval.split("-"))
    return start < b and a < end


def room_fits(request: dict, room: dict) -> bool:
    """Whether ``room`` satisfies every constraint of ``request``."""
    start = _minutes(request["time"])
    end = start + request["duration_min"]
    return (
        room["capacity"] >= request["attendees"]
        and all(n in room["equipment"] for n in request["needs"])
        and (room["accessible"] or not request["accessible_required"])
        and not any(overlaps(start, end, iv) for iv in room["booked"])
    )


def _free_bookings(rng: random.Random, start: int, end: int) -> list[str]:
    """0-2 bookings between 08:00 and 18:00 that do not touch ``[start, end)``."""
    out: list[str] = []
    for _ in range(rng.randint(0, 2)):
        for _try in range(20):
            a = rng.randrange(8 * 60, 17 * 60, 30)
            b = a + rng.choice([30, 60, 90])
            iv = f"{_hm(a)}-{_hm(b)}"
            if not overlaps(start, end, iv) and not any(overlaps(a, b, o) for o in out):
                out.append(iv)
                break
    return sorted(out)


def _clash_booking(rng: random.Random, start: int, end: int) -> str:
    """A booking that overlaps ``[start, end)`` by at least 30 minutes."""
    a = rng.choice([start - 30, start, start + 30 if end - start > 30 else start])
    b = max(a + 60, start + 30)
    return f"{_hm(a)}-{_hm(b)}"


def make_task(rng: random.Random, idx: int, n_rooms: int, correct_pos: int) -> dict:
    start = rng.randrange(9 * 60, 16 * 60, 30)
    duration = rng.choice([30, 60, 60, 90])
    end = start + duration
    attendees = rng.randint(3, 14)
    needs = sorted(rng.sample(EQUIPMENT, rng.choice([1, 1, 2])))
    accessible_required = rng.random() < 0.5
    request = {
        "date": rng.choice(DATES),
        "time": _hm(start),
        "duration_min": duration,
        "attendees": attendees,
        "needs": needs,
        "accessible_required": accessible_required,
    }

    # Failure kinds for the distractors; "accessible" only makes sense if access is required.
    kinds = [k for k in FAILURES if k != "accessible" or accessible_required]
    rng.shuffle(kinds)
    failures = (kinds * 2)[: n_rooms - 1]

    names = rng.sample(ROOM_NAMES, n_rooms)
    rooms = []
    distractor_failures = iter(failures)
    for pos in range(n_rooms):
        fail = None if pos == correct_pos else next(distractor_failures)
        capacity = attendees + rng.choice([0, 2, 4, 8])
        extra = [e for e in EQUIPMENT if e not in needs and rng.random() < 0.4]
        equipment = list(needs) + extra
        accessible = accessible_required or rng.random() < 0.5
        booked = _free_bookings(rng, start, end)
        if fail == "capacity":
            capacity = max(2, attendees - rng.choice([1, 2, 4]))
        elif fail == "equipment":
            missing = rng.choice(needs)
            equipment = [e for e in equipment if e != missing]
        elif fail == "accessible":
            accessible = False
        elif fail == "booked":
            clash = _clash_booking(rng, start, end)
            booked = sorted([b for b in booked if not overlaps(*map(_minutes, clash.split("-")), b)] + [clash])
        room = {
            "name": names[pos],
            "capacity": capacity,
            "equipment": sorted(equipment),
            "accessible": accessible,
            "booked": booked,
        }
        rooms.append(room)

    fitting = [r["name"] for r in rooms if room_fits(request, r)]
    assert fitting == [names[correct_pos]], (idx, fitting, rooms)
    return {"id": f"t{idx:02d}", "request": request, "rooms": rooms, "expected_choice": names[correct_pos]}


def make_tasks(seed: int = SEED, n: int = N_TASKS) -> list[dict]:
    """Generate ``n`` tasks deterministically from ``seed``."""
    rng = random.Random(seed)
    # Balanced layout, separately in each half (the train/validation split of agent.split): half
    # the tasks have 3 rooms, half 4, and the right room's position cycles through all places.
    layouts = []
    for half in (n // 2, n - n // 2):
        part = [(3 if i % 2 == 0 else 4, (i // 2) % (3 if i % 2 == 0 else 4)) for i in range(half)]
        rng.shuffle(part)
        layouts += part
    return [make_task(rng, i + 1, n_rooms, pos) for i, (n_rooms, pos) in enumerate(layouts)]


def render(tasks: list[dict]) -> str:
    return "".join(json.dumps(t, separators=(", ", ": ")) + "\n" for t in tasks)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="verify tasks.jsonl instead of writing it")
    args = p.parse_args(argv)
    text = render(make_tasks())
    if args.check:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT} is out of date; run {Path(__file__).name}", file=sys.stderr)
            return 1
        print(f"{OUT}: {N_TASKS} tasks OK")
        return 0
    OUT.write_text(text)
    print(f"wrote {N_TASKS} tasks to {OUT}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
