"""`streamlit run demos/streamlit_app.py`: the packaged demo (kvrag/demo/app.py), runnable from a clone.

Streamlit re-executes this file on every interaction; `runpy` re-executes the demo module each
time too (a plain import would run it only once per process, leaving reruns blank).

It serves this machine only: `demos/.streamlit/config.toml` sets server.address to 127.0.0.1. If
Streamlit runs it without an address (that file missing, or an older Streamlit that does not read
it), Streamlit listens on every interface, so the page refuses to run the demo and says how to
start it; an address given on purpose (`--server.address 0.0.0.0`) is served, with a warning.
"""

import runpy

import streamlit as st

if not st.get_option("server.address"):
    st.set_page_config(page_title="kvrag demo")
    st.error(
        "This server listens on every network interface (no server.address is set), so the demo will not run. "
        "Start it with `kvrag demo`, or `streamlit run demos/streamlit_app.py --server.address 127.0.0.1`."
    )
    st.stop()

runpy.run_module("kvrag.demo.app", run_name="__main__")
