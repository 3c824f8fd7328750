"""Writing a compiled output folder: plan.json, the templates, the copies of the runtime
and the contract (``codegen``), and the user's code files with what they import
(``outputfiles``)."""
