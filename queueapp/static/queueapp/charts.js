/* The admin's Charts page: draws the JSON series embedded in the page with the vendored uPlot (no CDN). */
(function () {
  "use strict";

  var SERIES = {
    ready: ["ready", "#2f6fb0"],
    leased: ["leased", "#d08a00"],
    delayed: ["delayed", "#7a5cc2"],
    dead: ["dead", "#b3261e"],
    published: ["published", "#2f6fb0"],
    claimed: ["claimed", "#d08a00"],
    acked: ["acked", "#1d8a3a"],
    dead_lettered: ["dead-lettered", "#b3261e"],
    suppressed: ["duplicates suppressed", "#7a5cc2"],
    stale: ["stale commits refused", "#b3261e"]
  };

  function options(element, names) {
    return {
      width: Math.max(element.clientWidth, 480),
      height: 220,
      scales: { x: { time: true } },
      axes: [{}, { label: element.dataset.unit || "", size: 60 }],
      series: [{}].concat(names.map(function (name) {
        var known = SERIES[name] || [name, "#555"];
        return { label: known[0], stroke: known[1], width: 2, points: { show: true, size: 4 } };
      }))
    };
  }

  function draw() {
    var source = document.getElementById("queueapp-series");
    if (!source || typeof window.uPlot !== "function") {
      return;
    }
    var data = JSON.parse(source.textContent);
    var charts = [];
    document.querySelectorAll("[data-chart]").forEach(function (element) {
      var group = data[element.dataset.chart] || {};
      var names = Object.keys(group);
      var columns = [data.t].concat(names.map(function (name) { return group[name]; }));
      charts.push(new window.uPlot(options(element, names), columns, element));
    });
    // Read by the browser test (and handy in a console): the drawn charts and their data.
    window.queueappCharts = charts;
    window.addEventListener("resize", function () {
      charts.forEach(function (chart) {
        chart.setSize({ width: Math.max(chart.root.parentNode.clientWidth, 480), height: 220 });
      });
    });
  }

  if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", draw);
  } else {
    draw();
  }
})();
