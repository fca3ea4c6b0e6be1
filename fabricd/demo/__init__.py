"""The demos behind ``make demo`` and ``fabricctl demo``.

* :mod:`~fabricd.demo.training`: the main job, eager-SGD hyperplane regression with sync, solo
  and majority allreduce on a local fabric (``fabricctl demo``);
* :mod:`~fabricd.demo.hyperplane`: its model and data, numpy only;
* :mod:`~fabricd.demo.plot`: its validation loss against time as a PNG (the ``demo`` extra);
* :mod:`~fabricd.demo.svm`: ASAP's SVM (SVM-SGD with model averaging over a communication
  graph), numpy only, with a lockstep simulation of every rank;
* :mod:`~fabricd.demo.svm_fabric`: that SVM on a local fabric through stochastic reduce
  (``python -m bench.svm``);
* :mod:`~fabricd.demo.ring`: a tensor passed around a ring of daemons, every byte verified
  (``fabricctl demo --ring``).
"""
