import gc, sys, time, json, os
if __name__ == "__main__":
    pauses = []
    t = {}
    def cb(phase, info):
        if phase == "start": t["s"] = time.perf_counter()
        else: pauses.append((info["generation"], (time.perf_counter() - t["s"]) * 1e3, time.time()))
    gc.callbacks.append(cb)
    if os.environ.get("FREEZE"):
        import elasticep.frontend.http_server  # the heavy imports, as serve has them
        gc.collect(); gc.freeze()
    from elasticep_testkit.serving import stub_serve
    try:
        rc = stub_serve.main(sys.argv[1:])
    finally:
        json.dump(pauses, open("/tmp/gc_pauses.json", "w"))
    sys.exit(rc)
