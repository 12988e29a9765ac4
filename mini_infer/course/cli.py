"""``mini-infer course``: the student package, the grader and the mutation check (appendix).

mini-infer course student OUT [--chapters 04-06]   write OUT/mini_infer with regions blanked
mini-infer course grade 04 --package DIR [--json]  grade DIR/mini_infer on chapter 04's tests
                                                   (exit 1, no points, when the tests cannot run)
mini-infer course regions                          list every assignment region
mini-infer course mutants 04 [--sample N] [--json] mutation score of chapter 04's graded tests
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _student(args: argparse.Namespace) -> int:
    from mini_infer.course.student import write_student_package

    regions = write_student_package(Path(args.out), args.chapters)
    chapters = sorted({r.chapter for r in regions})
    print(f"wrote {Path(args.out) / 'mini_infer'}: {len(regions)} regions blanked in chapters {chapters}")
    print(f"what to write: {Path(args.out) / 'ASSIGNMENTS.md'}; tests: {Path(args.out) / 'tests'}")
    return 0


def _grade(args: argparse.Namespace) -> int:
    import sys

    from mini_infer.course.grade import GradingError, grade, parse_chapter

    chapter = parse_chapter(args.chapter)
    try:
        report = grade(chapter, Path(args.package), timeout=args.timeout)
    except GradingError as exc:
        # No grade at all, not 0 points: the JSON has no "points" for a gradebook to record.
        if args.json:
            print(json.dumps({"chapter": chapter, "package": str(Path(args.package).resolve()), "error": str(exc)}))
        print(f"mini-infer: grading refused: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(report.to_json(), indent=2) if args.json else report.format())
    return 0


def _regions(args: argparse.Namespace) -> int:
    from mini_infer.course.regions import package_regions
    from mini_infer.course.student import PACKAGE

    for r in package_regions(PACKAGE):
        print(f"chapter {r.chapter:02d}  {r.path}:{r.begin_line}  {r.function}: {r.task}")
    return 0


def _mutants(args: argparse.Namespace) -> int:
    from mini_infer.course.grade import parse_chapter
    from mini_infer.course.mutants import behaviour_changing, mutants, run_mutants, sample

    chapter = parse_chapter(args.chapter)
    every = mutants(chapter)
    if not every:
        raise ValueError(f"chapter {chapter:02d} has no assignment region")
    # A sample draws from the mutants that change behaviour; a full run grades the known
    # equivalent ones too, so that a wrong verdict (an "equivalent" mutant that loses points) shows.
    chosen = every if args.sample is None else sample(behaviour_changing(every), args.sample, args.seed)
    killed = run_mutants(chosen)
    changing = [(m, k) for m, k in zip(chosen, killed) if m.equivalent is None]
    survivors = [m.description for m, k in changing if not k]
    wrong_verdicts = [m.description for m, k in zip(chosen, killed) if m.equivalent is not None and k]
    score = sum(k for _, k in changing) / len(changing) if changing else 1.0
    result = {
        "chapter": chapter,
        "mutants": len(chosen),
        "behaviour_changing": len(changing),
        "killed": sum(k for _, k in changing),
        "score": round(score, 3),
        "survivors": survivors,
        "equivalent": [f"{m.description}: {m.equivalent}" for m in chosen if m.equivalent is not None],
        "killed_but_marked_equivalent": wrong_verdicts,
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(
            f"chapter {chapter:02d}: {result['killed']} / {len(changing)} behaviour-changing mutants killed "
            f"({score:.0%}; {len(chosen)} mutants, {len(chosen) - len(changing)} known equivalent)"
        )
        for s in survivors:
            print(f"  survived: {s}")
        for s in wrong_verdicts:
            print(f"  marked equivalent but lost points (fix EQUIVALENT in mutants.py): {s}")
    return 1 if wrong_verdicts else 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="course_command", required=True)
    student = sub.add_parser("student", help="write the student package: the chosen chapters' regions blanked")
    student.add_argument("out", help="an empty directory: OUT/mini_infer, OUT/tests, OUT/ASSIGNMENTS.md")
    student.add_argument("--chapters", default=None, help="04, 04-06 or 02,04 (default: every chapter with regions)")
    student.set_defaults(func=_student)
    grade = sub.add_parser("grade", help="run a chapter's graded tests against DIR/mini_infer, print the points")
    grade.add_argument("chapter", help="04 or 4")
    grade.add_argument("--package", required=True, help="the directory that holds the mini_infer to grade")
    grade.add_argument("--json", action="store_true", help="points, total and every test's result as JSON")
    grade.add_argument("--timeout", type=float, default=600.0, help="seconds before the run counts as failed")
    grade.set_defaults(func=_grade)
    regions = sub.add_parser("regions", help="list every assignment region of the package")
    regions.set_defaults(func=_regions)
    mut = sub.add_parser("mutants", help="mutation score of a chapter's graded tests (mutants must lose points)")
    mut.add_argument("chapter", help="04 or 4")
    mut.add_argument("--sample", type=int, default=None, help="run a seeded sample of this many mutants")
    mut.add_argument("--seed", type=int, default=0)
    mut.add_argument("--json", action="store_true")
    mut.set_defaults(func=_mutants)
