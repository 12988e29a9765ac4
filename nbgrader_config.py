"""nbgrader's configuration for a course built from this book's chapters.

nbgrader reads ``nbgrader_config.py`` from the course folder (the folder it is run in): copy this
file there, or run nbgrader from a checkout of this repository. Three settings, all for the steps
that *execute* a notebook (``nbgrader validate`` and ``nbgrader autograde``); ``generate_assignment``
executes nothing and is unchanged by them:

* **an execution timeout per cell** (``ExecutePreprocessor.timeout``, which nbgrader's ``Execute``
  inherits): nbgrader's default is 30 s, shorter than a chapter's slowest cells on a laptop CPU,
  and a student's endless loop must still end;
* **a kernel client whose waits are short** (``mini_infer.course.kernel_client``): nbclient
  sometimes misses a kernel's reply that has arrived (jupyter/nbclient#312, seen with the
  chapters' widget cells) and sits idle until the cell timeout; with short waits it sees it at once;
* **timing cells are skipped**: a code cell tagged ``timing`` (the chapter's measurement: a
  wall-clock comparison, a benchmark) has its source replaced by a comment before the notebook
  runs. A timing grades nothing, costs minutes and depends on the grading machine. Tag only cells
  whose results no graded cell uses; a graded or solution cell cannot be skipped (the grader
  stops with an error naming it). The student version keeps these cells: students measure on
  their own runtime, which is the chapter's point. A notebook without the tag runs every cell.

``scripts/make_student_versions.py`` runs ``nbgrader generate_assignment`` with this file, and
``tests/test_nbgrader_config.py`` checks each setting, through nbgrader itself.
"""

from typing import Any

from nbgrader.converters import Autograde
from nbgrader.preprocessors import Execute, NbGraderPreprocessor
from nbgrader.validator import Validator
from traitlets import Unicode

c = get_config()  # noqa: F821 (nbgrader defines get_config while it reads this file)

# Seconds per cell. The chapters' slowest cells take well under a minute on a 2-core CPU with the
# tiny model (book/contributing.md: about a minute per chapter); five minutes leaves room for a
# slow grading machine and still ends an endless loop.
c.ExecutePreprocessor.timeout = 300

# The kernel manager nbclient starts for each notebook hands out this client (any KernelManager
# subclass reads the section): a missed reply costs half a second, not the 300 s above.
c.KernelManager.client_class = "mini_infer.course.kernel_client.ShortWaitKernelClient"

TIMING_TAG = "timing"
SKIPPED_SOURCE = (
    "# Skipped while grading: a timing cell (tag 'timing', see nbgrader_config.py).\n"
    "# Run the notebook yourself to see its measurement."
)


class SkipTimingCells(NbGraderPreprocessor):
    """Replace the source of every code cell tagged ``timing`` by a comment, before execution."""

    tag = Unicode(TIMING_TAG, help="the cell tag that marks a timing cell").tag(config=True)

    def preprocess_cell(self, cell: Any, resources: Any, index: int) -> tuple[Any, Any]:
        if cell.cell_type != "code" or self.tag not in cell.get("metadata", {}).get("tags", []):
            return cell, resources
        nbgrader = cell.metadata.get("nbgrader", {})
        if nbgrader.get("grade") or nbgrader.get("solution") or nbgrader.get("task"):
            raise ValueError(
                f"cell {index} ({nbgrader.get('grade_id', 'no grade_id')}) is tagged {self.tag!r} but is an "
                f"nbgrader graded, solution or task cell, which must run: remove the tag from that cell"
            )
        cell.source = SKIPPED_SOURCE
        cell.outputs = []
        cell.execution_count = None
        return cell, resources


def before_execute(preprocessors: list) -> list:
    """nbgrader's own list of preprocessors with SkipTimingCells inserted right before Execute."""
    if Execute not in preprocessors:
        raise RuntimeError(f"nbgrader_config.py: no Execute step in {preprocessors}: this nbgrader is not supported")
    at = preprocessors.index(Execute)
    return [*preprocessors[:at], SkipTimingCells, *preprocessors[at:]]


c.Autograde.autograde_preprocessors = before_execute(Autograde.class_traits()["autograde_preprocessors"].default())
c.Validator.preprocessors = before_execute(Validator.class_traits()["preprocessors"].default())
