from rknnlite.api.rknn_lite import RKNNLite
