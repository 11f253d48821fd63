"""Scale-out on Ray Serve (the `cluster` extra): engine replicas behind one OpenAI endpoint.

    ort-kvlayout serve MODEL_DIR --replicas 2          # a local Ray cluster, two engines
    serve run docs/cluster.yaml                         # the same from a Serve config

app.py builds the application (options, deployments), replica.py wraps one Engine per replica,
router.py routes each request by the replicas' load (Ray Serve's request router API),
client.py and ingress.py serve server.py's own app over the replicas, run.py is the CLI's side
(start, wait, drain). Nothing here is imported unless the extra is installed and asked for.
"""
