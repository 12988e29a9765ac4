"""Graded tests, one file per chapter (appendix): ``mini-infer course grade NN`` runs them.

Each test is behavioural (it calls the package's public functions and checks results computed
here from first principles, never by the package's own code for the same thing) and carries
``@pytest.mark.points(n)``. tests/test_course.py proves, per chapter, that the reference earns
every point, the blank student package none, and that mutants of the regions lose points.
"""
