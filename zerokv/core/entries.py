"""The ops' compiled entries: once the compiled executor runs the calls, ``merge_plans.two``,
``merge_states_plan.n`` and ``empty_rows_plan.run`` become its entries, which run a call's recent
bound calls in C and hand every other call to the Python entries (``python_two``, ``python_n``,
``python_run``) unchanged; ``two`` reads a call by :meth:`zerokv.core.entry_args.Layout.table`. While ``executor.run`` is not the compiled ``run_either`` (the Python
executor chosen, or ``zerokv.testing`` recording on it) the entries decline at once.
"""

from __future__ import annotations

from typing import Any

from . import bound, empty_rows_plan, executor, merge_plans, merge_states_plan, plans, pyexec


def install(module: Any) -> None:
    module.bind_entries(
        vars(executor), plans.recent, bound.BoundCall, pyexec.run,
        merge_plans.python_two, merge_states_plan.python_n, empty_rows_plan.python_run, merge_plans.LAYOUT.table(),
    )  # fmt: skip
    merge_plans.two, merge_states_plan.n, empty_rows_plan.run = module.two, module.n, module.empty_rows


executor.on_compiled(install)
