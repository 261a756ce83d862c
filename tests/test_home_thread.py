"""kvrag.model.home_thread: a serving process runs every model call on one thread (torch's OpenMP
teams: a second thread running parallel regions made decoding ~1.6x slower); elsewhere nothing changes."""

import threading


from kvrag.model.home_thread import HomeThread


def test_without_a_serving_thread_calls_run_where_they_are_made():
    home = HomeThread()
    assert not home.serving and home.call(threading.get_ident) == threading.get_ident()


def test_calls_from_other_threads_run_on_the_home_thread_in_order_and_errors_come_back():
    home, stop = HomeThread(), threading.Event()
    home_ident, results, errors = [], [], []
    server = threading.Thread(target=lambda: (home_ident.append(threading.get_ident()), home.serve(stop)))
    server.start()
    while not home.serving:
        pass

    def client(i: int) -> None:
        results.append((i, home.call(threading.get_ident), home.call(lambda: home.call(threading.get_ident))))
        try:
            home.call(lambda: 1 / 0)
        except ZeroDivisionError as exc:
            errors.append(exc)

    clients = [threading.Thread(target=client, args=(i,)) for i in range(4)]
    for t in clients:
        t.start()
    for t in clients:
        t.join(10)
    stop.set()
    home.wake()
    server.join(10)
    assert len(results) == 4 and all(a == b == home_ident[0] for _, a, b in results)  # nested calls run in place
    assert len(errors) == 4 and not home.serving
    assert home.call(threading.get_ident) == threading.get_ident()  # stopped: inline again


def test_calls_queued_when_it_stops_fail_instead_of_waiting_forever():
    home, stop = HomeThread(), threading.Event()
    release = threading.Event()
    server = threading.Thread(target=home.serve, args=(stop,))
    server.start()
    while not home.serving:
        pass
    outcome = []
    busy = threading.Thread(target=lambda: outcome.append(home.call(lambda: release.wait(10) and "done")))
    busy.start()
    queued_error = []

    def queued() -> None:
        try:
            home.call(lambda: "never")
        except RuntimeError as exc:
            queued_error.append(str(exc))

    waiter = threading.Thread(target=queued)
    waiter.start()
    stop.set()
    release.set()
    for t in (busy, waiter, server):
        t.join(10)
    assert outcome == ["done"]
    assert queued_error == ["the server is shutting down"] or queued_error == []  # ran first, or refused: never stuck
    assert not waiter.is_alive()
