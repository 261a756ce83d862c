"""`streamlit run demos/streamlit_app.py`: the packaged demo (kvrag/demo_app.py), runnable from a clone.

Streamlit re-executes this file on every interaction; `runpy` re-executes the demo module each
time too (a plain import would run it only once per process, leaving reruns blank).
"""

import runpy

runpy.run_module("kvrag.demo_app", run_name="__main__")
