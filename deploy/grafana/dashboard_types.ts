// Types the dashboard JSON is checked against (tests/integration/test_deploy_dashboard.py writes a
// .ts file with the dashboard as a literal and runs `tsc --strict --noEmit`).
// @grafana/schema and typescript are pinned in scripts/install-tools.sh.
import type { Dashboard, DataQuery } from '@grafana/schema';
import type { Options as TimeSeriesOptions } from '@grafana/schema/dist/esm/raw/composable/timeseries/panelcfg/x/TimeSeriesPanelCfg_types.gen';
import type { Options as StatOptions } from '@grafana/schema/dist/esm/raw/composable/stat/panelcfg/x/StatPanelCfg_types.gen';

// JSON spells enum members by value ("absolute", "list"): accept exactly those values.
export type Json<T> = T extends string
  ? `${T}`
  : T extends readonly (infer U)[]
    ? Json<U>[]
    : T extends object
      ? { [K in keyof T]: Json<T[K]> }
      : T;

// A Prometheus panel query (the Prometheus data source's query model).
export interface PromQuery extends DataQuery {
  expr: string;
  legendFormat?: string;
  range?: boolean;
  instant?: boolean;
  interval?: string;
  format?: 'time_series' | 'table' | 'heatmap';
}

export type DashboardJson = Json<Dashboard>;
export type PromQueries = Json<PromQuery>[];
// Options of the panel plugins the dashboard uses, by panel `type`.
export interface PanelOptions {
  timeseries: Json<TimeSeriesOptions>;
  stat: Json<StatOptions>;
}
